"""What episodes take from the config, and the longest context one can reach (what an engine that sizes
its cache once is asked for)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EpisodeSettings:
    """What an episode rollout needs from the config (``[env]``, ``[data]``, ``[grpo]``)."""

    max_turns: int = 8
    max_observation_tokens: int = 256
    max_prompt_tokens: int = 400
    error_penalty: float = -1.0
    discount: float = 1.0
    system_prompt: str | None = None
    template: str = "auto"

    @classmethod
    def from_config(cls, cfg) -> EpisodeSettings:
        e = cfg.env
        return cls(
            e.max_turns,
            e.max_observation_tokens,
            cfg.data.max_prompt_tokens,
            e.error_penalty,
            cfg.grpo.turn_reward_discount,
            cfg.data.system_prompt,
            cfg.model.chat_template,
        )


def longest_episode(settings: EpisodeSettings, max_new: int) -> int:
    """The longest context an episode can reach: its prompt, every sampled token and ``max_turns - 1``
    observations."""
    return (
        settings.max_prompt_tokens
        + max_new
        + max(settings.max_turns - 1, 0) * settings.max_observation_tokens
    )


@dataclass
class AgentSettings:
    """What agent episodes need from the config (``[env]``, ``[model]``; the longest context as an
    environment episode's)."""

    max_turns: int = 8
    """Model calls per episode (``env.max_turns``)."""
    max_len: int = 2048
    """The longest context a request may build."""
    error_penalty: float = -1.0
    template: str = "auto"
    model_name: str = "nanogrpo"
    max_body_bytes: int = 1 << 20

    @classmethod
    def from_config(cls, cfg) -> AgentSettings:
        e = cfg.env
        longest = longest_episode(EpisodeSettings.from_config(cfg), cfg.rollout.max_new_tokens)
        name = cfg.model.path if isinstance(cfg.model.path, str) and cfg.model.path else "nanogrpo"
        return cls(e.max_turns, longest, e.error_penalty, cfg.model.chat_template, name)
