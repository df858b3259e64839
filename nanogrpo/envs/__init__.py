"""Multi-turn environments: the interface (:mod:`.base`), where one comes from (:mod:`.load`), how
their calls run (:mod:`.runner`), agent programs (:mod:`.program`) and the adapters of other libraries'
environments (:mod:`.adapters`). Nothing here knows tokens, engines or training: the episodes that
train on them (the model's turns, rendering, what is trained) are :mod:`nanogrpo.episodes`."""

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
