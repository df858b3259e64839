"""``rm:PATH_OR_HUB_ID``: a sequence-classification reward model scores each (prompt, completion).

A reward model sits behind the runner's model-reward interface, as a judge does
(:mod:`nanogrpo.rewards.judges`); it loads with the policy's loaders (:mod:`nanogrpo.models.load`), and
:func:`model_rewards` is the maker of ``rm:`` specs that :func:`nanogrpo.rewards.reward_runner` (the runner
every command builds) hands :class:`~nanogrpo.rewards.RewardRunner` (``judge:`` specs it builds itself).

The model is a Hugging Face ``AutoModelForSequenceClassification`` with one output (Skywork-Reward,
the OpenAssistant DeBERTa reward models and the like; a local directory or a hub id), loaded once, on
first use, on ``rewards.rm_device`` (``auto``: the trainer's device; in split mode the rollout
worker's), in bfloat16 on a GPU and float32 on the CPU. ``rm:embedded-rm`` is the demo's own reward
model, found by the model name its package registers (:mod:`nanogrpo.entry_points`), as a policy's
``embedded-NAME`` is; it ships in ``nanogrpo/demos/rm/weights``, built by ``nanogrpo/demos/rm/build.py``.

What it reads, as such models expect it:

- a tokenizer with a chat template: the conversation ``[*prompt turns, {"role": "assistant",
  "content": completion}]`` rendered by the template and tokenized without adding special tokens
  (the template holds them). The prompt turns are the row's chat turns (``sample["messages"]``) when
  it has them, else one user turn with ``sample["question"]``; the training system prompt (the
  policy's format instructions) is not shown;
- a tokenizer without one: the text pair ``(question, completion)`` as the tokenizer encodes pairs
  (``[CLS] question [SEP] completion [SEP]`` for BERT-style models).

A text longer than the model takes keeps its last tokens (the chat form) or is cut by the tokenizer's
pair truncation (counted in ``rm/truncated``). Rows are sorted by length and grouped into forwards of
at most ``rewards.rm_batch_tokens`` padded tokens (right padding); each score is the model's single
logit, equal up to float rounding to a forward of that row alone, whatever else shares its batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nanogrpo.errors import ModelError, RewardError
from nanogrpo.models.load import GENERIC_TOKENIZER_CLASSES, resolve_device, saved_tokenizer_class
from nanogrpo.models.source import resolve_model_path
from nanogrpo.rewards.calls import ERROR, OK, Outcome, check_value, one_line
from nanogrpo.rewards.entries import ModelReward

__all__ = ["RewardModel", "EMBEDDED_RM", "prompt_turns_of", "resolve_rm_source", "model_rewards"]

log = logging.getLogger("nanogrpo.rewards")

EMBEDDED_RM = "embedded-rm"
"""The demo's reward model, shipped with the package (``nanogrpo/demos/rm/weights``)."""


def resolve_rm_source(source: str) -> str:
    """A demo's shipped weights (``embedded-rm``), a local directory (checked) or a hub id, as a policy's
    path is resolved (:func:`~nanogrpo.models.source.resolve_model_path`)."""
    try:
        return resolve_model_path(source)
    except ModelError as e:
        raise RewardError(f"reward 'rm:{source}': {e}") from None


def prompt_turns_of(sample: dict) -> list[dict[str, str]]:
    """The conversation before the completion: the row's chat turns, else one user turn."""
    turns = sample.get("messages")
    if isinstance(turns, list) and turns and all(isinstance(t, dict) for t in turns):
        return [{"role": str(t.get("role")), "content": str(t.get("content"))} for t in turns]
    return [{"role": "user", "content": str(sample.get("question", ""))}]


def _load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    """The tokenizer saved with the model (a generic fast tokenizer, like the embedded char-level one, as
    exactly that; see :func:`nanogrpo.models.load.load_tokenizer`). A classifier needs no EOS token."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if saved_tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


class RewardModel:
    """A reward model as a model reward of :class:`~nanogrpo.rewards.RewardRunner` (see the module
    docstring). ``device``: a torch device name or ``auto`` (CUDA when present, else the CPU)."""

    scalable = True
    """``rewards.rm_scale`` applies to its scores."""

    def __init__(self, source: str, *, device: str = "auto", batch_tokens: int = 16384,
                 name: str | None = None, metric_prefix: str = "rm", trust_remote_code: bool = False):
        if batch_tokens < 1:
            raise RewardError(f"rm_batch_tokens must be >= 1, got {batch_tokens}")
        self.source = source
        self.name = name or f"rm:{source}"
        self.path = resolve_rm_source(source)
        self.device_name = device
        self.batch_tokens = batch_tokens
        self.prefix = metric_prefix
        self.trust_remote_code = trust_remote_code
        self._check_config()
        self.model = None
        self.tokenizer = None
        self._stats: dict[str, float] = {}

    # ------------------------------------------------------------------ loading

    def _check_config(self) -> None:
        """Fail at start, before any weights are read, on a model that is no one-output classifier."""
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as e:
            raise RewardError(f"reward {self.name!r}: cannot read its config ({one_line(e)})") from None
        arch = list(getattr(cfg, "architectures", None) or [])
        if arch and not any(a.endswith("ForSequenceClassification") for a in arch):
            raise RewardError(f"reward {self.name!r}: the model is a {arch[0]}, not a sequence-classification"
                              " model (a reward model has a one-output score head; this one's would be "
                              "random)")
        if cfg.num_labels != 1:
            raise RewardError(f"reward {self.name!r}: the model has {cfg.num_labels} outputs; a reward model "
                              "has one (num_labels = 1)")

    def start(self) -> None:
        """Load the tokenizer and the weights (once)."""
        if self.model is not None:
            return
        import torch
        from transformers import AutoModelForSequenceClassification

        try:
            device = resolve_device(self.device_name)
        except Exception as e:  # noqa: BLE001 - ModelError with the device's name
            raise RewardError(f"reward {self.name!r}: rewards.rm_device: {e}") from None
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        t0 = time.perf_counter()
        try:
            tok = _load_tokenizer(self.path, self.trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                self.path, dtype=dtype, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as e:
            raise RewardError(f"reward {self.name!r}: cannot load the model ({one_line(e)})") from None
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokenizer = tok
        self.device = device
        text_cfg = model.config.get_text_config()
        self._own_pad = text_cfg.pad_token_id  # the model's convention: pooled at the last non-pad token
        limits = [getattr(text_cfg, "max_position_embeddings", None), getattr(tok, "model_max_length", None)]
        self.max_length = min([int(x) for x in limits if isinstance(x, int) and 0 < x < 10**7] or [10**7])
        log.warning("reward %r: loaded on %s (%s, %.1f M parameters) in %.1f s", self.name, device,
                    str(dtype).replace("torch.", ""), sum(p.numel() for p in model.parameters()) / 1e6,
                    time.perf_counter() - t0)

    def close(self) -> None:
        self.model = None
        self.tokenizer = None

    # ------------------------------------------------------------------ formatting

    def encode(self, completion: str, sample: dict) -> tuple[dict[str, list[int]], bool]:
        """What the model reads for one row (``input_ids``, and ``token_type_ids`` for a text pair
        where the tokenizer makes them), and whether it was cut to fit."""
        self.start()
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            conv = [*prompt_turns_of(sample), {"role": "assistant", "content": completion}]
            text = tok.apply_chat_template(conv, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_length:
                return {"input_ids": ids[-self.max_length:]}, True
            return {"input_ids": ids}, False
        question = str(sample.get("question", ""))
        enc = tok(question, completion)
        cut = len(enc["input_ids"]) > self.max_length
        if cut:
            enc = tok(question, completion, truncation=True, max_length=self.max_length)
        return {k: list(enc[k]) for k in ("input_ids", "token_type_ids") if k in enc}, cut

    # ------------------------------------------------------------------ scoring

    def score(self, completions: list[str], samples: list[dict]) -> list[Outcome]:
        self.start()
        import torch

        t0 = time.perf_counter()
        out: list[Outcome] = [(ERROR, "not scored")] * len(completions)
        encoded: dict[int, dict[str, list[int]]] = {}
        truncated = 0
        for i, (c, s) in enumerate(zip(completions, samples, strict=True)):
            try:
                encoded[i], cut = self.encode(c, s)
                truncated += cut
            except Exception as e:  # noqa: BLE001 - a template that rejects this row's turns, say
                out[i] = (ERROR, f"cannot format the row for the reward model ({one_line(e)})")
        tokens = 0
        for rows in self.batches({i: len(enc["input_ids"]) for i, enc in encoded.items()}):
            width = max(len(encoded[i]["input_ids"]) for i in rows)
            pad = self._pad_id([encoded[i]["input_ids"] for i in rows])
            inputs = {"input_ids": torch.full((len(rows), width), pad, dtype=torch.long),
                      "attention_mask": torch.zeros((len(rows), width), dtype=torch.long)}
            if "token_type_ids" in encoded[rows[0]]:
                inputs["token_type_ids"] = torch.zeros((len(rows), width), dtype=torch.long)
            for j, i in enumerate(rows):
                n = len(encoded[i]["input_ids"])
                inputs["attention_mask"][j, :n] = 1
                for key, values in encoded[i].items():
                    inputs[key][j, :n] = torch.tensor(values)
            tokens += int(inputs["attention_mask"].sum())
            try:
                with torch.inference_mode():
                    logits = self._forward({k: v.to(self.device) for k, v in inputs.items()}, pad)
            except RuntimeError as e:  # out of memory, a shape the model rejects
                for i in rows:
                    out[i] = (ERROR, f"reward model forward failed ({one_line(e)})")
                continue
            for j, i in enumerate(rows):
                out[i] = check_value(logits[j])
        dt = time.perf_counter() - t0
        scored = sum(1 for kind, _ in out if kind == OK)
        p = self.prefix
        self._stats = {f"{p}/time_s": dt, f"{p}/rows_per_s": scored / dt if dt > 0 else 0.0,
                       f"{p}/tokens_per_s": tokens / dt if dt > 0 else 0.0,
                       f"{p}/truncated": float(truncated)}
        return out

    def batches(self, lengths: dict[int, int]) -> list[list[int]]:
        """Rows grouped longest first so that rows x longest length <= ``batch_tokens`` (at least one row)."""
        order = sorted(lengths, key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= self.batch_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _pad_id(self, rows: list[list[int]]) -> int:
        """The model's own pad id when its config names one; else an id no row of this batch holds, so that
        the head reads each row's last token, as in a forward of the row alone."""
        if self._own_pad is not None:
            return int(self._own_pad)
        used = set().union(*map(set, rows))
        candidates = [self.tokenizer.pad_token_id] if self.tokenizer.pad_token_id is not None else []
        vocab = self.model.config.get_text_config().vocab_size
        return next(t for t in [*candidates, *range(vocab - 1, -1, -1)] if t not in used)

    def _forward(self, inputs: dict[str, Any], pad: int) -> list[float]:
        text_cfg = self.model.config.get_text_config()
        text_cfg.pad_token_id = pad  # a decoder's head pools at each row's last token that is not `pad`
        try:
            logits = self.model(**inputs).logits
        finally:
            text_cfg.pad_token_id = self._own_pad
        return logits[:, 0].float().tolist()

    def metrics(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        return stats

    def __repr__(self) -> str:
        return f"RewardModel({self.source!r}, device={self.device_name!r})"


def model_rewards(cfg: Any, device: str = "auto") -> Callable[[str, str], ModelReward]:
    """The maker of ``rm:`` entries for :meth:`RewardRunner.from_config` (``make_rm``): ``(spec, metric
    prefix) -> RewardModel`` with the ``rewards`` config's settings (``rm_device`` ``auto``: ``device``)."""
    def make(spec: str, prefix: str) -> ModelReward:
        return RewardModel(spec.partition(":")[2].strip(), device=device if cfg.rm_device == "auto"
                           else cfg.rm_device, batch_tokens=cfg.rm_batch_tokens, name=spec,
                           metric_prefix=prefix)

    return make

