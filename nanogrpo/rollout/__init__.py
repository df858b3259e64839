"""Rollout engines: token ids in, completion ids + log-probs out (see ``engine.py``)."""

from nanogrpo.rollout.engine import Engine, Generation, SamplingParams
from nanogrpo.rollout.factory import make_engine
from nanogrpo.rollout.fast import FastEngine
from nanogrpo.rollout.hf import HFEngine

__all__ = ["Engine", "Generation", "SamplingParams", "HFEngine", "FastEngine", "make_engine"]
