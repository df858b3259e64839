"""The whole config (every section, the checks across sections) and how one is built: files, presets,
``section.key=value`` overrides, one-line errors."""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from nanogrpo import entry_points
from nanogrpo.config.base import _Strict
from nanogrpo.config.data import DataConfig
from nanogrpo.config.distill import DistillConfig
from nanogrpo.config.env import EnvConfig
from nanogrpo.config.grpo import GrpoConfig
from nanogrpo.config.model import ModelConfig
from nanogrpo.config.moe import MoeConfig, check_moe
from nanogrpo.config.rewards import RewardsConfig
from nanogrpo.config.rollout import RolloutConfig, VllmConfig, VllmServerConfig
from nanogrpo.config.run import EvalConfig, LogConfig, ServerConfig, TrainConfig
from nanogrpo.config.tools import ToolsConfig
from nanogrpo.config.watch import WatchConfig
from nanogrpo.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Config(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    vllm_server: VllmServerConfig = Field(default_factory=VllmServerConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    watch: WatchConfig = Field(default_factory=WatchConfig)
    moe: MoeConfig = Field(default_factory=MoeConfig)

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        g, r = self.grpo, self.rollout
        if g.mini_batches > r.prompts_per_step:
            raise ValueError(f"grpo.mini_batches={g.mini_batches} cuts a batch of rollout.prompts_per_step="
                             f"{r.prompts_per_step} groups into more mini-batches than it has groups")
        buf = self.rewards.overlong_buffer
        if buf is not None and buf > r.max_new_tokens:
            raise ValueError(f"rewards.overlong_buffer={buf} is longer than rollout.max_new_tokens="
                             f"{r.max_new_tokens}: the punishment would start before the first token")
        if self.env.source:
            with_env(self.rewards)
        check_server_tier(self)
        check_distill(self)
        check_moe(self)
        if self.env.source and self.tools.enabled:
            raise ValueError("env.source and tools.enabled both make multi-turn rollouts; use one (an "
                             "environment runs model-written code through its sandbox handle)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def load(cls, source: str | Path | None = None, overrides: Overrides = ()) -> Config:
        """From a TOML/YAML/JSON file or the name of a shipped preset (``demo``, ``demo-tools``);
        None: the demo preset, as ``nanogrpo train`` with no ``--config``. ``overrides`` as on the
        command line (``["train.steps=2"]``) or as a dict (``{"train.steps": 2}``)."""
        return config_from(source, overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], overrides: Overrides = ()) -> Config:
        """From nested sections (``{"train": {"steps": 2}}``; dotted keys, ``{"train.steps": 2}``, too)
        over the defaults (the seed's), then ``overrides``; checked like a file (unknown keys and bad
        values are a :class:`ConfigError`)."""
        sections = _copy_sections({k: v for k, v in data.items() if "." not in str(k)}, "the dict")
        _apply_overrides(sections, {k: v for k, v in data.items() if "." in str(k)})
        return _validate(_apply_overrides(sections, overrides),
                         "a dict" + (" + overrides" if overrides else ""))

    def with_overrides(self, overrides: Overrides) -> Config:
        """A new config: this one with ``overrides`` applied (this one is left as it is)."""
        return Config.from_dict(self.to_dict(), overrides)




def check_server_tier(cfg: Config) -> None:
    """The keys of the server tier (``rollout.engine=vllm_server``) agree with the rest (ValueError)."""
    r = cfg.rollout
    if r.engine == "vllm_server":
        if not r.servers:
            raise ValueError("rollout.engine=vllm_server needs rollout.servers, e.g. "
                             "rollout.servers='[\"http://127.0.0.1:8100\"]' (start them with "
                             "nanogrpo vllm-serve)")
        for url in r.servers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"rollout.servers: {url!r} is not an http(s):// URL")
        if len(set(r.servers)) != len(r.servers):
            raise ValueError("rollout.servers lists a server twice")
        if cfg.train.backend == "deepspeed" and cfg.train.zero_stage == 3:
            raise ValueError("rollout.engine=vllm_server syncs the weights from the trainer's parameters, "
                             "which ZeRO-3 partitions: use train.backend=fsdp2 (gathered tensor by tensor) "
                             "or ZeRO-1/2")
    elif r.servers:
        raise ValueError(f"rollout.servers is set but rollout.engine={r.engine}: set "
                         "rollout.engine=vllm_server")
    if r.max_staleness and r.engine != "vllm_server":
        raise ValueError("rollout.max_staleness > 0 overlaps generation on vLLM servers with the update: it "
                         "needs rollout.engine=vllm_server")
    if r.max_staleness and cfg.train.save_every_updates:
        raise ValueError("rollout.max_staleness > 0 with train.save_every_updates: mid-batch checkpoints "
                         "are for the on-policy loop; set one of them to 0")


def check_distill(cfg: Config) -> None:
    """``[distill]`` agrees with the rest (ValueError)."""
    d = cfg.distill
    if not d.teacher:
        return
    if cfg.grpo.dynamic_sampling:
        raise ValueError("grpo.dynamic_sampling refills groups whose rewards all agree, but with "
                         "distill.teacher every group carries the teacher's signal (none is dropped): "
                         "set one of them off")
    if cfg.grpo.importance_sampling == "sequence" or cfg.grpo.loss == "gspo":
        raise ValueError("distill.teacher gives a signal per token; grpo.loss=gspo (a sequence-level ratio) "
                         "cannot carry it: use a token-level loss (grpo, dapo, dr_grpo, bnpo, cispo, sapo)")


def with_env(rewards: RewardsConfig) -> None:
    """An environment's episodes are scored by their return, the ``env`` reward: ``rewards.functions`` left
    at its default becomes ``["env"]``; a list without ``env`` gets it first (weight 1)."""
    if "functions" not in rewards.model_fields_set:
        rewards.functions, rewards.weights = ["env"], None
    elif "env" not in [f.strip() for f in rewards.functions]:
        rewards.weights = None if rewards.weights is None else [1.0, *rewards.weights]
        rewards.functions = ["env", *rewards.functions]
    rewards.model_fields_set.add("functions")


RUN_CONFIG_FILE = "config.yaml"
"""A run directory's resolved config (written at start; ``--resume`` reads it back)."""




def preset_names() -> list[str]:
    """The presets of the registered demos (``demo``, ``demo-NAME``: one per demo; and any an installed
    package registers, :mod:`nanogrpo.entry_points`), sorted."""
    return entry_points.preset_names()


def _not_found(path: Path) -> ConfigError:
    """``config file not found``, with the shipped presets (and the closest) when ``path`` reads as one."""
    names = preset_names()
    close = difflib.get_close_matches(path.stem, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"config file not found: {path}; shipped presets: {', '.join(names)}{hint}; ready "
                       "configs for real models are files in the repository's configs/ "
                       "(--config configs/NAME.toml)")


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise _not_found(path)
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown extension {path.suffix!r} "
                              "(use .toml, .yaml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        first = str(e).splitlines()[0]
        raise ConfigError(f"config file {path} is malformed: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table of sections, "
                          f"got {type(data).__name__}")
    return data


def preset_path(name: str) -> Path:
    """Path of a preset: the ``preset.toml`` of the demo that registers it (``demo`` is
    ``nanogrpo/demos/arithmetic/preset.toml``, ``demo-NAME`` ``nanogrpo/demos/NAME/preset.toml``); for a
    name no demo registers, the one-line ``config file not found`` that lists the presets."""
    found = entry_points.preset_file(name)
    if found is None:
        raise _not_found(Path(name))
    return found


class _Yaml12(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: ``true`` / ``false`` only. YAML 1.1 also reads
    ``off``, ``on``, ``yes``, ``no`` as booleans, which would turn ``moe.routing_replay=off`` (a word
    the key takes) into ``False``."""


_Yaml12.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def yaml_load(text: str) -> Any:
    """YAML as a config reads it: :class:`_Yaml12` (``off`` is a word, ``true`` a boolean)."""
    return yaml.load(text, Loader=_Yaml12)  # noqa: S506 (a SafeLoader)


def _parse_value(raw: str, item: str = "") -> Any:
    """An override's value: YAML (which reads JSON: ``[1, 2]``, ``"s"``, ``{"a": 1}``, and TOML's scalars and
    arrays alike: ``true``, ``'s'``, ``1e-6``), or TOML where only TOML reads it: an inline table
    ``{retry = true}``, which YAML takes for a key ``"retry = true"`` without a value; text that is
    neither (``{a: 1, b=2}``) is refused in one line. Text that neither parses stays text."""
    if raw.lstrip().startswith("#"):  # YAML would read it as a comment (None): e.g. answer_delimiter=####
        return raw
    try:
        value = yaml_load(raw)
    except yaml.YAMLError:
        return _toml_value(raw, raw)
    if not _has_toml_keys(value):
        return value
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"override {item or raw!r}: {raw.strip()!r} is neither JSON/YAML nor TOML; write a "
                          "table as {key = value, ...} (TOML) or {\"key\": value, ...} (JSON)") from None


def _toml_value(raw: str, otherwise: Any) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return otherwise


def _has_toml_keys(value: Any) -> bool:
    """YAML's reading of TOML's ``key = value``: a mapping key holding ``=``, with no value."""
    if isinstance(value, dict):
        return any((isinstance(k, str) and "=" in k and v is None) or _has_toml_keys(v)
                   for k, v in value.items())
    if isinstance(value, list):
        return any(_has_toml_keys(v) for v in value)
    return False


def _known_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``section.key=value`` override to a nested dict, in place."""
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    key, raw = item.split("=", 1)
    set_key(data, key, _parse_value(raw, item), item)


def set_key(data: dict[str, Any], key: str, value: Any, item: str | None = None) -> None:
    """Set ``section.key`` (or ``section.table.key``: a key of a table inside a section, e.g. a
    ``[watch]`` rule's) of a nested dict to ``value``, in place (``item`` names it in errors)."""
    item = item if item is not None else f"{key}={value!r}"
    parts = key.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"override key {key!r} must be section.key (e.g. grpo.beta=0.04), or "
                          "section.table.key (watch.entropy_collapse.floor=0.005)")
    section, name = parts[:2]
    fields = Config.model_fields
    if section not in fields:
        hint = difflib.get_close_matches(section, list(fields), n=1)
        raise ConfigError(
            f"unknown config section {section!r} in override {item!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    data.setdefault(section, {})
    if not isinstance(data[section], dict):
        raise ConfigError(f"config section {section!r} must be a table")
    if len(parts) == 3:  # a key of a table inside the section (pydantic checks that it is one)
        table = data[section].setdefault(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{section}.{name} is not a table: {item!r} sets a key inside it")
        table[parts[2]] = value
        return
    data[section][name] = value


Overrides = Union[Sequence[str], Mapping[str, Any]]
"""``["section.key=value", ...]`` (values read as YAML, as on the command line) or
``{"section.key": value}`` (values taken as they are)."""


def _apply_overrides(data: dict[str, Any], overrides: Overrides | None) -> dict[str, Any]:
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_key(data, str(key), value)
    elif isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'section.key=value' strings or a dict, not the "
                          f"string {overrides!r}")
    else:
        for item in overrides or ():
            apply_override(data, item)
    return data


def _copy_sections(data: Any, origin: str) -> dict[str, Any]:
    """A copy of ``data`` deep enough that overrides do not write into the caller's dicts."""
    if isinstance(data, Config):
        return data.to_dict()
    if not isinstance(data, Mapping):
        raise ConfigError(f"config from {origin}: expected a mapping of sections, got {type(data).__name__}")
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _format_validation_error(e: ValidationError, origin: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        parts = [str(x) for x in err["loc"]]
        model: type[BaseModel] = Config
        for p in parts[:-1]:
            ann = model.model_fields.get(p)
            sub = getattr(ann, "annotation", None)
            if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
                break
            model = sub
        hint = difflib.get_close_matches(parts[-1], _known_keys(model), n=1)
        return f"unknown config key {loc!r} in {origin}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    msg = err["msg"]
    if err["type"] == "value_error":  # our own validators: their message names the key already
        return f"{msg.removeprefix('Value error, ')} (in {origin})"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"bad config value for {loc!r} in {origin}: {msg}{more}"


def load_config(path: str | Path | None = None, overrides: Overrides | None = None,
                preset: str | None = None) -> Config:
    """Build a validated :class:`Config` from an optional preset, file and overrides."""
    data: dict[str, Any] = {}
    origins = []
    if preset is not None:
        data = _read_file(preset_path(preset))
        origins.append(f"preset {preset}")
    if path is not None:
        file_data = _read_file(Path(path))
        for section, values in file_data.items():
            if isinstance(values, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
        origins.append(str(path))
    _apply_overrides(data, overrides)
    if overrides:
        origins.append("overrides")
    return _validate(data, " + ".join(origins) or "defaults")


def _validate(data: dict[str, Any], origin: str) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin)) from None


def presets() -> list[str]:
    """Names of the presets (:func:`preset_names`)."""
    return preset_names()


def config_from(source: str | Path | None = None, overrides: Overrides = ()) -> Config:
    """The config a command starts from: ``source`` is a TOML/YAML/JSON file or, when no such file
    exists, the name of a shipped preset; None is the demo preset. ``overrides`` apply on top."""
    if source is None:
        return load_config(preset="demo", overrides=overrides)
    if not Path(source).exists() and entry_points.preset_file(str(source)) is not None:
        return load_config(preset=str(source), overrides=overrides)
    return load_config(source, overrides)


def save_config(cfg: Config, path: Path) -> None:
    """Write atomically (a temporary file renamed over ``path``): a reader, e.g. another rank
    resuming the run, sees the old file or the new one, never a half-written one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)
