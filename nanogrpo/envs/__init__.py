"""Multi-turn environments: the interface (:mod:`.base`), where one comes from (:mod:`.load`) and how
their calls run (:mod:`.runner`). The episode rollout that trains on them is
:mod:`nanogrpo.rollout.episodes`."""

from nanogrpo.envs.base import Environment, EnvResultError, Message, Observation, StepResult, as_step_result
from nanogrpo.envs.load import LOADERS, resolve
from nanogrpo.envs.runner import EnvRunner, Outcome

__all__ = [
    "Environment",
    "EnvResultError",
    "EnvRunner",
    "LOADERS",
    "Message",
    "Observation",
    "Outcome",
    "StepResult",
    "as_step_result",
    "resolve",
]
