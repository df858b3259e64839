"""Datasets and prompts: sources (presets, files, HF datasets, the demos' tasks by their registered
names), chat/plain prompt rendering, and a resumable prompt sampler.

Nothing is loaded at import; ``datasets`` and ``pyarrow`` are imported only by
the sources that need them.
"""

from nanogrpo.data.prompts import build_messages, encode_prompts, render_prompt, render_samples
from nanogrpo.data.sampler import PromptSampler
from nanogrpo.data.samples import extract_answer, normalize_rows
from nanogrpo.data.sources import PRESETS, load_eval_rows, load_rows

__all__ = [
    "PromptSampler",
    "build_messages",
    "encode_prompts",
    "extract_answer",
    "load_eval_rows",
    "load_rows",
    "PRESETS",
    "normalize_rows",
    "render_prompt",
    "render_samples",
]
