"""verifiers 0.4's own TextArena environment (its ``TextArenaEnv``, which steps the real TextArena engine,
and its taskset's ``load``) on a game that needs no downloaded data: ``GuessTheNumber-v0``. verifiers'
``TextArenaConfig`` lists only word games (Wordle, Hangman, ...), which need NLTK's word lists from the
network; this module widens the game to any TextArena id and exports the pair as an environment
package does (``env.source = "verifiers:tests.verifiers_v1_textarena:GameTaskset"``)."""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.tasksets.textarena.taskset import (
    TextArenaConfig,
    TextArenaEnv,
    TextArenaTask,
    TextArenaTaskset,
)


class GameConfig(TextArenaConfig):
    game: str = "GuessTheNumber-v0"


class GameTaskset(vf.Taskset[TextArenaTask, GameConfig]):
    INFINITE = True
    load = TextArenaTaskset.load


__all__ = ["GameTaskset", "TextArenaEnv"]
