"""vLLM in the caller's process: importing it (or one line saying how to install it), undoing what
building ``vllm.LLM`` does to the process (:func:`guard_process_state`), dropping the messages it
logs that say nothing to a nanogrpo user (:data:`NOISE`), and the cause of a failed build in one line
(:func:`build_cause`)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator

import torch

from nanogrpo.errors import ConfigError


def import_vllm():
    """``vllm`` itself, or a one-line error saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError("rollout.engine=vllm needs vLLM: pip install -e \".[vllm]\" (on a CPU machine see "
                          f"docs/guides/vllm.md), or use rollout.engine=fast ({e})") from None
    return vllm



class DropNoise(logging.Filter):
    """vLLM messages that are expected here and say nothing to a nanogrpo user."""

    NOISE = ("Chat template warmup failed",              # no tokenizer: we pass token ids
             "RotaryEmbedding: Failed to load weights",    # every reload: RoPE has no weights
             "CPU backend doesn't allow to use `torch.set_num_threads`",  # its stub; we put torch's back
             "libtcmalloc is not found in LD_PRELOAD",     # tuning advice for vLLM's own processes
             "libiomp is not found in LD_PRELOAD",
             "Using None for EOS token id",                # we pass the EOS ids with every request
             "The global random seed is set to",           # we put the RNG states back
             "This model does not officially support disabling chunked prefill")  # CPU: see __init__

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(msg.startswith(n) for n in self.NOISE)


NOISE = DropNoise()


@contextlib.contextmanager
def guard_process_state() -> Iterator[None]:
    """Undo what building ``vllm.LLM`` in-process does to the process (see the module docstring)."""
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    preload = os.environ.get("LD_PRELOAD")
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"building vLLM left torch at {torch.get_num_threads()} threads, not {threads}")


def build_cause(err: BaseException) -> str:
    """The line of a vLLM build error that says why: a pydantic ``ValidationError`` (vLLM's config checks)
    opens with "1 validation error for VllmConfig"; its first error's message is the cause."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            return str(first.get("msg", "")).splitlines()[0] or type(err).__name__
        except (TypeError, IndexError, KeyError, AttributeError):
            pass
    text = str(err)
    return text.splitlines()[0] if text else type(err).__name__
