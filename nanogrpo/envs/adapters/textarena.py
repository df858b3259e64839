"""``env.source = "textarena:GAME-ID"``: a single-player TextArena game as an environment.

Each episode makes its own game (``textarena.make(GAME-ID, **env.kwargs)``, the game's registered
wrappers included, so its action format rules apply) and resets it with a seed from the row
(``row["seed"]``, else a stable hash of ``row["id"]`` / the question): the episodes of a group play the
same game, as GRPO compares them. The first observation is the game's prompt; after each move, the
game's new messages (the player's own move left out: the model has it in context). At the end the
game's reward for player 0 is the turn's reward; ``success`` is a reward of at least 1 (TextArena's
single-player games give 1 for a solved game and a partial score otherwise). The game's messages are
joined no further than ``max_observation_bytes`` (set by the rollout): past it the observation is
refused (``too_long``) without being built whole.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from nanogrpo.envs.adapters.common import require
from nanogrpo.envs.base import Environment, ObservationTooLong, StepResult

_SEEDING = threading.Lock()
"""TextArena seeds Python's global ``random`` in ``reset`` and draws from it there: one reset at a time."""


def seed_of(row: dict[str, Any]) -> int:
    if isinstance(row.get("seed"), int):
        return row["seed"]
    key = str(row.get("id") or row.get("question") or "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


class TextArenaEnv(Environment):
    def __init__(self, game_id: str, **make_kwargs):
        self.game_id, self.make_kwargs = game_id, make_kwargs
        self.game = None

    def reset(self, row: dict[str, Any]) -> str:
        ta = require("textarena", "textarena", "env.source 'textarena:...'")
        self.game = ta.make(env_id=self.game_id, **self.make_kwargs)
        with _SEEDING:
            self.game.reset(num_players=1, seed=seed_of(row))
        return self._news()

    def step(self, action: str) -> StepResult:
        done, _ = self.game.step(action)
        if done:
            rewards, info = self.game.close()
            reward = float((rewards or {}).get(0, 0.0))
            reason = (info or {}).get(0, {}).get("reason")
            return StepResult(None, reward, True, {"success": reward >= 1.0, "reason": reason})
        return StepResult(self._news())

    def _news(self) -> str:
        base = self.game
        while hasattr(base, "env"):  # the wrappers keep the game in .env
            base = base.env
        me = base.state.current_player_id
        cap, size, parts = self.max_observation_bytes, 0, []
        for frm, msg, _ in base.state.get_current_player_observation():
            if frm == me:
                continue
            text = str(msg).strip()
            size += len(text) + 1  # characters: at least as many bytes
            if cap is not None and size > cap:
                raise ObservationTooLong(f"{self.game_id}: its observation holds more than {cap} characters, "
                                         "more than an observation may hold")
            parts.append(text)
        return "\n".join(parts).strip()


def load(rest: str, kwargs: dict):
    """The factory for ``textarena:GAME-ID``; an unknown id is a one-line error at start."""
    ta = require("textarena", "textarena", "env.source 'textarena:...'")
    from textarena.envs.registration import ENV_REGISTRY

    from nanogrpo.errors import ConfigError

    if rest not in ENV_REGISTRY:
        close = [k for k in ENV_REGISTRY if rest.split("-")[0].lower() in k.lower()][:5]
        raise ConfigError(f"env.source 'textarena:{rest}': no such TextArena game"
                          + (f"; did you mean {', '.join(close)}?" if close else ""))
    del ta
    return lambda: TextArenaEnv(rest, **kwargs)
