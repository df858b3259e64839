"""Typed configuration: one source of truth for every hyperparameter.

A config is built from (lowest to highest precedence) the defaults of the sections below, an
optional TOML/YAML file, and ``section.key=value`` overrides from the command line. Unknown keys,
wrong types and out-of-range values are errors raised once, at start, as a :class:`ConfigError`
with a one-line message naming the key.

The defaults are the seed's (Qwen2.5 on GSM8K: G=8, beta=0.03, lr=1e-6, temperature 0.9, 512 new
tokens, prompts of at most 400 tokens, save every 200 steps). The embedded CPU demo that
``nanogrpo train`` runs with no arguments is the preset ``demo`` layered on top of these.

One module per section (``model``, ``data``, ``rollout`` with ``vllm``, ``grpo``, ``rewards``,
``distill``, ``tools``, ``env``, ``run``: train / eval / log / server, ``watch``); ``root`` puts them together
and reads files, presets and overrides.
"""

from nanogrpo.config.base import _Strict
from nanogrpo.config.data import PROMPT_TEMPLATES, R1_BOXED_INSTRUCTION, SEED_SYSTEM_PROMPT, DataConfig
from nanogrpo.config.distill import DistillConfig
from nanogrpo.config.env import EnvConfig
from nanogrpo.config.grpo import AdvantageName, GrpoConfig, LossName
from nanogrpo.config.model import ModelConfig
from nanogrpo.config.rewards import RewardsConfig
from nanogrpo.config.rollout import RolloutConfig, VllmConfig
from nanogrpo.config.root import (
    RUN_CONFIG_FILE,
    Config,
    Overrides,
    apply_override,
    config_from,
    load_config,
    preset_path,
    presets,
    save_config,
    set_key,
)
from nanogrpo.config.run import EvalConfig, LogConfig, ServerConfig, TrainConfig
from nanogrpo.config.tools import DEFAULT_PRELOAD, ToolsConfig
from nanogrpo.config.watch import RULE_NAMES, WatchConfig
from nanogrpo.errors import ConfigError

__all__ = [
    "AdvantageName", "Config", "ConfigError", "DEFAULT_PRELOAD", "DataConfig", "DistillConfig", "EnvConfig",
    "EvalConfig",
    "GrpoConfig", "LogConfig", "LossName", "ModelConfig", "Overrides", "PROMPT_TEMPLATES",
    "R1_BOXED_INSTRUCTION",
    "RUN_CONFIG_FILE", "RewardsConfig", "RolloutConfig", "SEED_SYSTEM_PROMPT", "ServerConfig",
    "RULE_NAMES", "ToolsConfig", "TrainConfig", "VllmConfig", "WatchConfig", "apply_override", "config_from",
    "load_config",
    "preset_path", "presets", "save_config", "set_key", "_Strict",
]
