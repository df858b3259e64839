"""The endpoint's life: an OpenAI-compatible server (and vLLM's token route) on 127.0.0.1 for the length
of a rollout.

    with Endpoint(engine, tokenizer, params, EndpointSettings(max_len=2048, max_new_tokens=256,
                                                              vocab_size=len(tokenizer))) as ep:
        key = ep.open_episode()            # the episode's api_key
        ... start the agent program with base_url=ep.url, api_key=key (another thread) ...
        ep.serve(until=programs_done)      # this thread runs the engine
        log = ep.close_episode(key)        # every request's exact token ids and log-probs

It binds to the loopback address only (there is no setting for another: the models it serves are
the policy being trained, and nothing outside this machine has a reason to reach them) on a port the
system picks, and answers only requests carrying the key of an episode still open. The engine is
driven by the thread that calls :meth:`Endpoint.serve` (the one that owns the model), never by the
HTTP thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from nanogrpo.engines.base import Engine, SamplingParams
from nanogrpo.episodes.endpoint.batcher import Batcher
from nanogrpo.episodes.endpoint.records import EpisodeLog, OpenEpisodes
from nanogrpo.errors import ConfigError

HOST = "127.0.0.1"
log = logging.getLogger("nanogrpo.episodes")


@dataclass(frozen=True)
class EndpointSettings:
    max_len: int
    """The longest context a request may build (prompt + sampled tokens)."""
    max_new_tokens: int
    """The most tokens an episode samples over all its requests (``rollout.max_new_tokens``); a
    request's ``max_tokens`` may lower its own share; past it requests are refused (400, ``max_tokens``)."""
    vocab_size: int
    """Token ids a ``/v1/completions`` prompt may hold: ``[0, vocab_size)``."""
    max_turns: int = 64
    """The most model calls an episode may make; later ones are refused (400, ``max_turns``)."""
    max_body_bytes: int = 1 << 20
    """Request bodies past this are refused while they arrive (413)."""
    body_timeout_s: float = 30.0
    model_name: str = "nanogrpo"
    """What ``/v1/models`` lists (a request may name any model: there is one)."""
    template: str = "auto"
    """``model.chat_template``: ``auto`` (the tokenizer's) or ``plain``."""


class Endpoint:
    def __init__(self, engine: Engine, tokenizer, params: SamplingParams, settings: EndpointSettings,
                 *, linger_s: float = 0.01):
        self.tokenizer = tokenizer
        self.settings = settings
        self.episodes = OpenEpisodes()
        self.batcher = Batcher(engine, tokenizer, params, linger_s=linger_s)
        self.unauthorized = 0
        self.version: int | str = 0
        """The policy version the engine samples under (the token route's ``weight_versions``)."""
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ life
    def start(self) -> Endpoint:
        try:
            import uvicorn
        except ImportError:
            raise ConfigError("the agent endpoint needs starlette and uvicorn: "
                              "pip install 'nanogrpo[serve]'") from None
        from nanogrpo.episodes.endpoint.app import create_app

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((HOST, 0))
        sock.listen(512)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=60)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="nanogrpo-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError("the agent endpoint did not start (uvicorn)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.batcher.close()
        self.episodes.close_all()
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> Endpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The ``base_url`` to give an OpenAI client (``http://127.0.0.1:PORT/v1``)."""
        if self.port is None:
            raise RuntimeError("the endpoint is not started")
        return f"http://{HOST}:{self.port}/v1"

    # ------------------------------------------------------------------ episodes
    def open_episode(self) -> str:
        """A new episode; its key (the ``api_key`` its program uses)."""
        return self.episodes.open(self.settings.max_new_tokens)

    def close_episode(self, key: str) -> EpisodeLog:
        """The episode's requests, in the order they were answered; its key is refused from now on."""
        return self.episodes.close(key)

    @property
    def session_key(self) -> str:
        """The key of the token route's sessions (:mod:`~nanogrpo.episodes.endpoint.records`)."""
        return self.episodes.session_key

    def open_sessions(self) -> None:
        """Accept sessions (each with the episode budget, ``max_new_tokens``) until :meth:`close_sessions`."""
        self.episodes.open_sessions(self.settings.max_new_tokens)

    def close_session(self, sid: str) -> EpisodeLog | None:
        """Session ``sid``'s requests (None: it made none); refused from now on."""
        return self.episodes.close_session(sid)

    def close_sessions(self) -> list[EpisodeLog]:
        """Stop accepting sessions; the logs no one claimed."""
        return self.episodes.close_sessions()

    def serve(self, until, poll_s: float = 0.02) -> None:
        """Run the engine on this thread for the requests that arrive, until ``until()`` is true and
        no request waits."""
        self.batcher.serve(until, poll_s)

    # ------------------------------------------------------------------ prompts
    def render(self, messages: list[dict], tools: list | None = None) -> str:
        """Chat messages as the model reads them: the tokenizer's chat template (with ``tools`` when
        given) or the plain one (``model.chat_template=plain``), with the assistant's turn opened."""
        if tools:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        from nanogrpo.data.prompts import render_prompt

        return render_prompt(self.tokenizer, messages, self.settings.template)
