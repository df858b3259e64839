"""``[data]``: the dataset, the reference answers, the prompt; the ready prompts."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from nanogrpo.config.base import _Strict

SEED_SYSTEM_PROMPT = (
    "You are a helpful assistant. A conversation between User and Assistant. The user asks a question, "
    "and the Assistant solves it. The Assistant first thinks about the reasoning process in the mind and "
    "then provides the user with the answer.The reasoning process and answer are enclosed within "
    "<think> </think> and<answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think><answer> answer here </answer>."
)


R1_BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_TEMPLATES: dict[str, dict[str, str]] = {
    "think_answer": {"system_prompt": SEED_SYSTEM_PROMPT, "user_template": "{question}"},
    "r1_boxed": {"system_prompt": "", "user_template": "{question}\n" + R1_BOXED_INSTRUCTION},
    "boxed_system": {"system_prompt": R1_BOXED_INSTRUCTION, "user_template": "{question}"},
}
"""Ready prompts (``data.prompt_template``): the seed's think/answer system prompt; DeepSeek-R1's
recommendation (no system prompt, the instruction after the question; reward with ``format_boxed``);
Qwen2.5-Math's (the same instruction as the system prompt)."""

class DataConfig(_Strict):
    source: str = "gsm8k"
    """A preset (``gsm8k``, ``math``, ``math500``, ``aime24``, ``aime``, ``deepscaler``, ``arithmetic``,
    ``multidigit``, ``game``, ``dialogue``, ``vision``), a file (.jsonl/.json/.parquet/.csv), or
    ``hf:NAME``."""
    split: str = "train"
    """The split trained on (of a preset, an ``hf:`` dataset, or ``{split}`` in a file path)."""
    eval_split: str = "test"
    """The split held-out problems come from (``eval.every``, ``nanogrpo eval``)."""
    eval_source: str | None = None
    """Where held-out problems come from, as ``source`` (e.g. train on ``math``, evaluate on
    ``math500``); None: ``source``."""
    question_field: str = "question"
    """The column holding the question (files and ``hf:`` datasets; presets know their own)."""
    answer_field: str = "answer"
    """The column holding the reference answer (files and ``hf:`` datasets; presets know their own)."""
    answer_from: Literal["auto", "column", "boxed", "delimiter"] = "auto"
    """Where the reference is in the answer field: ``column``: all of it (MATH-500's ``answer``,
    AIME's integer); ``boxed``: the last ``\\boxed{…}`` of a full solution (MATH's ``solution``);
    ``delimiter``: after the last ``answer_delimiter`` (GSM8K's ``####``); ``auto``: ``boxed`` when
    the field holds a ``\\boxed{``, else ``delimiter`` when it holds the delimiter, else ``column``.
    A row without what the mode needs is an error naming the row, at start."""
    answer_delimiter: str | None = None
    """The delimiter of ``answer_from=delimiter``; None: ``####``."""
    hf_config: str | None = None
    """The configuration name of an ``hf:`` dataset (``datasets.load_dataset(NAME, hf_config)``)."""
    prompt_template: str | None = None
    """A ready prompt by name (``think_answer``, ``r1_boxed``, ``boxed_system``: see
    ``PROMPT_TEMPLATES``); it sets ``system_prompt`` and ``user_template``, which then are not set
    by hand."""
    system_prompt: str = SEED_SYSTEM_PROMPT
    """The system turn of every prompt (default: the seed's think/answer instruction); empty: none.
    A row's own ``system`` column wins."""
    user_template: str = "{question}"
    """The user turn: ``{question}`` is replaced by the question (``"{question}\\nPlease reason step by
    step, and put your final answer within \\boxed{}."``; other braces are kept as written)."""
    few_shot: list[dict[str, str]] = Field(default_factory=list)
    """Worked examples (``question``/``answer``) rendered as earlier chat turns."""
    max_prompt_tokens: int = Field(400, gt=0)
    """Prompts longer than this (in tokens, chat template included) are skipped, as in the seed."""
    shuffle: bool = True
    """Draw prompts in a seeded random order (``train.seed``); False: in file order. Resumable either way."""
    image_field: str = "images"
    """The column holding a row's images (vision-language models): one image or a list, each a file
    path (relative to the dataset file), bytes, a PIL image or an HF ``datasets`` Image dict; URLs are
    refused. Rows without the column have no images. Read and checked at start
    (``nanogrpo.data.images``)."""
    image_placeholder: str = "<image>"
    """Where a row's text puts its images, one placeholder per image in order; a row with images and
    no placeholder gets them before its question."""
    max_image_pixels: int | None = Field(None, gt=0)
    """Images are resized (aspect kept, sides multiples of the model's patch x merge size) to at most
    this many pixels; None: the model's processor's bound. An image over 64x this is refused at start."""
    min_image_pixels: int | None = Field(None, gt=0)
    """Images are resized up to at least this many pixels; None: the model's processor's bound."""
    generated_train_size: int = Field(20000, gt=0)
    """Rows of a generated source's train split: a registered task made in code (the demos'
    ``arithmetic``, ``multidigit``, ``game``, ``dialogue``, ``vision``; a package's own) or a
    ``verifiers:`` taskset's own tasks."""
    generated_eval_size: int = Field(500, gt=0)
    """Rows of a generated source's held-out split (disjoint from the train split)."""

    renamed: ClassVar[dict[str, str]] = {"data.arithmetic_train_size": "data.generated_train_size",
                                         "data.arithmetic_eval_size": "data.generated_eval_size"}

    @model_validator(mode="before")
    @classmethod
    def _expand_prompt_template(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("prompt_template") is None:
            return data
        name = data["prompt_template"]
        if name not in PROMPT_TEMPLATES:
            raise ValueError(f"unknown prompt template {name!r} (ready ones: {', '.join(PROMPT_TEMPLATES)})")
        data = dict(data)
        for key, value in PROMPT_TEMPLATES[name].items():
            if key in data and data[key] != value:
                raise ValueError(f"data.prompt_template={name} sets data.{key}; drop one of the two")
            data[key] = value
        return data

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if "{question}" not in self.user_template:
            raise ValueError("data.user_template must contain {question}, where the question goes")
        if self.answer_delimiter is not None and self.answer_from in ("column", "boxed"):
            raise ValueError(f"data.answer_delimiter is read with data.answer_from=delimiter (or auto), "
                             f"not {self.answer_from}")
        return self
