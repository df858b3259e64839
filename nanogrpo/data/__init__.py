"""Datasets and prompts: sources (presets, files, HF datasets), the embedded
arithmetic task, chat/plain prompt rendering, and a resumable prompt sampler.

Nothing is loaded at import; ``datasets`` and ``pyarrow`` are imported only by
the sources that need them.
"""

from nanogrpo.data.prompts import build_messages, encode_prompts, render_prompt, render_samples
from nanogrpo.data.sampler import PromptSampler
from nanogrpo.data.samples import extract_answer, normalize_rows
from nanogrpo.data.sources import PRESETS, load_eval_rows, load_rows
from nanogrpo.demos.arithmetic.task import make_split, solution

__all__ = [
    "PromptSampler",
    "build_messages",
    "encode_prompts",
    "extract_answer",
    "load_eval_rows",
    "load_rows",
    "PRESETS",
    "make_split",
    "normalize_rows",
    "render_prompt",
    "render_samples",
    "solution",
]
