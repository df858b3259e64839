"""An OpenAI-compatible endpoint in front of a rollout engine, for agent programs (``server.py``:
its life; ``app.py``: the routes; ``episodes.py``: what is recorded; ``batcher.py``: requests batched
into engine calls)."""

from nanogrpo.rollout.endpoint.episodes import EpisodeLog, Record
from nanogrpo.rollout.endpoint.server import HOST, Endpoint, EndpointSettings

__all__ = ["HOST", "Endpoint", "EndpointSettings", "EpisodeLog", "Record"]
