"""Files for end-to-end ``nanogrpo train`` tests: a random-init tiny model and GSM8K-format rows."""

from __future__ import annotations

import json
from pathlib import Path

from nanogrpo.training.logging_sinks import TIMING_KEYS
from nanogrpo.training.metrics import read_metrics


def write_tiny_run_assets(d: Path, rows: int = 12, seed: int = 3) -> Path:
    """``d/model`` (tiny Qwen2 + char tokenizer) and ``d/data.jsonl`` ("i+i?", "#### 2i"); returns ``d``."""
    from nanogrpo.models.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model("tiny", tok, seed=seed).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    with open(d / "data.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"question": f"{i}+{i}?", "answer": f"#### {2 * i}"}) + "\n")
    return d


def evaluated_on(data: Path) -> str:
    """The override by which a run on one data file evaluates on that same file: on its own, a single file
    gives no held-out rows and the run evaluates nothing (the rows would be its training rows); these tests
    exercise the evaluation path, not what it measures."""
    return f"data.eval_source={json.dumps(str(data))}"


def comparable_metrics(run: Path, drop_eval: bool = False) -> list[dict]:
    """A run's metrics without timings (and, with ``drop_eval``, without ``eval/`` keys: a run cut
    short also evaluates at its own last step)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and not (drop_eval and k.startswith("eval/"))}
            for r in read_metrics(Path(run) / "metrics.jsonl")]


def this_process_threads() -> dict[str, str]:
    """Environment for a ``nanogrpo`` subprocess whose results are compared exactly with this process's:
    the same number of CPU threads (the tests run on one, tests/conftest.py), where it would otherwise
    take one per core of whatever machine runs the tests. Exactness is promised within one process
    configuration; a reduction split over another number of threads may round differently."""
    import torch

    n = str(torch.get_num_threads())
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
