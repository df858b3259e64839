"""An OpenAI-compatible endpoint in front of a rollout engine, for agent programs (``server.py``:
its life; ``app.py``: the routes; ``records.py``: what is recorded per episode; ``tokens.py``: vLLM's
token route; ``batcher.py``: requests batched into engine calls)."""

from nanogrpo.episodes.endpoint.records import EpisodeLog, Record
from nanogrpo.episodes.endpoint.server import HOST, Endpoint, EndpointSettings

__all__ = ["HOST", "Endpoint", "EndpointSettings", "EpisodeLog", "Record"]
