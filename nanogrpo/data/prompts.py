"""From a sample to prompt token ids: chat turns, rendering, encoding.

Turn order: one system turn (the sample's ``system`` column if it is non-empty
text, else the configured system prompt; none if that is empty), then each
few-shot example as a user/assistant pair, then the sample's own turns (its
``messages`` if it is chat-formatted, else one user turn with its question put
into ``data.user_template``, e.g. the R1 prompt's ``"{question}\\nPlease reason
step by step, and put your final answer within \\boxed{}."``). A chat-formatted
sample that brings its own system turn keeps it, and the configured/``system``-
column prompt is not added.

Rendering (``model.chat_template``):

- ``auto``: the tokenizer's chat template with ``add_generation_prompt=True``
  (the seed's way); a tokenizer without one is an error, not a silent fallback.
- ``plain``, for base models without a template::

      {system}\\n\\n            (only when there is a system prompt)
      User: {question}\\n
      Assistant: {answer}\\n     (each few-shot pair / earlier turn)
      ...
      User: {question}\\n
      Assistant:

Prompts longer than ``data.max_prompt_tokens`` are skipped, as in the seed
(which drops the whole batch; nanogrpo drops only the long prompts).
"""

from __future__ import annotations

from typing import Any, Literal

from nanogrpo.config import DataConfig
from nanogrpo.data.samples import prompt_turns
from nanogrpo.errors import DataError, ModelError

Template = Literal["auto", "plain"]


def _system_text(sample: dict[str, Any], system_prompt: str | None) -> str:
    own = sample.get("system")
    if isinstance(own, str) and own.strip():
        return own
    return system_prompt or ""


def user_turn(question: str, user_template: str = "{question}") -> str:
    """The user turn for ``question``: ``{question}`` in ``user_template`` replaced by it (only that:
    the template's other braces, ``\\boxed{}``, stay as written)."""
    return user_template.replace("{question}", question)


def _few_shot_turns(few_shot: list[dict[str, Any]], user_template: str) -> list[dict[str, str]]:
    turns = []
    for k, ex in enumerate(few_shot):
        if not isinstance(ex, dict) or not isinstance(ex.get("question"), str) or "answer" not in ex:
            raise DataError(f"data.few_shot[{k}] needs 'question' and 'answer' entries")
        turns.append({"role": "user", "content": user_turn(ex["question"], user_template)})
        turns.append({"role": "assistant", "content": str(ex["answer"])})
    return turns


def build_messages(sample: dict[str, Any], system_prompt: str | None,
                   few_shot: list[dict[str, Any]], user_template: str = "{question}") -> list[dict[str, str]]:
    """Chat turns for one sample: system, few-shot pairs, then the sample's question (in
    ``user_template``) or its own turns."""
    own_turns = prompt_turns(sample.get("messages"))
    if own_turns and own_turns[0]["role"] == "system":
        head = [own_turns.pop(0)]
    else:
        system = _system_text(sample, system_prompt)
        head = [{"role": "system", "content": system}] if system else []
    tail = own_turns or [{"role": "user", "content": user_turn(sample["question"], user_template)}]
    return head + _few_shot_turns(few_shot, user_template) + tail


def render_plain(messages: list[dict[str, str]]) -> str:
    """The plain template (see module docstring), ending with ``"Assistant:"``."""
    parts = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            if content:
                parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"User: {content}\n")
        elif role == "assistant":
            parts.append(f"Assistant: {content}\n")
        else:
            parts.append(f"{role.capitalize()}: {content}\n")
    parts.append("Assistant:")
    return "".join(parts)


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], template: Template = "auto") -> str:
    """Prompt text for ``messages``: the tokenizer's chat template (``auto``) or the plain one."""
    if template == "plain":
        return render_plain(messages)
    if template != "auto":
        raise ModelError(f"unknown chat template mode {template!r} (use auto or plain)")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ModelError(f"tokenizer {name!r} has no chat template; "
                         f"set model.chat_template=plain for base models")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_samples(tokenizer: Any, samples: list[dict[str, Any]], cfg: DataConfig,
                   template: Template = "auto") -> list[str]:
    """Prompt text for each sample, with ``cfg.system_prompt``, ``cfg.few_shot`` and ``cfg.user_template``."""
    return [render_prompt(tokenizer, build_messages(s, cfg.system_prompt, cfg.few_shot, cfg.user_template),
                          template)
            for s in samples]


def encode_prompts(tokenizer: Any, samples: list[dict[str, Any]], cfg: DataConfig,
                   template: Template = "auto") -> tuple[list[list[int]], list[int]]:
    """Prompt token ids (no special tokens added) and the indices of the samples skipped as too long.

    The id lists are for the kept samples only, in order: ``ids[k]`` belongs to the k-th sample
    whose index is not in ``skipped``.
    """
    if not samples:
        return [], []
    texts = render_samples(tokenizer, samples, cfg, template)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids: list[list[int]] = []
    skipped: list[int] = []
    for i, seq in enumerate(encoded):
        if len(seq) > cfg.max_prompt_tokens:
            skipped.append(i)
        else:
            ids.append(list(seq))
    return ids, skipped
