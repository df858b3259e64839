"""The distillation demo's teacher: the careless warm start, trained further on careful solutions.

The student is the default demo's warm start (``embedded``, :mod:`nanogrpo.demos.arithmetic.build`): it
writes the right equation in ``<think>`` and, in 60% of its training solutions, the question's first number
in ``<answer>``, so greedy decoding is right 7% of the time. The teacher starts from those same weights
and takes ``STEPS`` more supervised steps on fresh training problems whose every solution is careful (the
answer is the result, ``CARELESS_RATE`` 0), on the warm start's recipe (AdamW, warm-up and cosine decay,
one thread, fixed seeds). It keeps the student's shape and tokenizer (same vocabulary: the distillation's
signals compare the two models' probabilities of the same token ids) and answers ~94% of the held-out
problems right (2026-12-03). Nothing of the test split is trained on.

Shipped in ``nanogrpo/demos/distill/weights/`` (model path ``embedded-distill``); rebuild with
``python -m nanogrpo.demos.distill.build --out DIR`` (200 steps: about 4 minutes on a quiet 2-core CPU).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanogrpo.config import load_config
from nanogrpo.demos.arithmetic.build import embedded_path, encode_solutions
from nanogrpo.demos.arithmetic.task import make_split
from nanogrpo.demos.warm_start import builder_main, one_thread, train_and_save
from nanogrpo.models.load import load_model, load_tokenizer

SEED = 4321
"""The teacher's problems and its run's seed (the warm start's are 1234)."""
STEPS, BATCH_SIZE, LR = 200, 64, 1e-3


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships what this program builds."""
    return Path(__file__).resolve().parent / "weights"


def build(out: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
          log_every: int = 50) -> Path:
    """Train the teacher from the shipped warm start and save it (HF format) to ``out`` atomically."""
    with one_thread():  # built on one thread, as the warm start: the same reduction order
        torch.manual_seed(SEED)
        src = str(embedded_path())
        tok = load_tokenizer(src)
        model = load_model(src, torch.float32, torch.device("cpu"), cpu_linear="torch")
        data_cfg = load_config(preset="demo").data
        rows = make_split("train", steps * batch_size, seed=SEED)
        seqs, trained = encode_solutions(tok, rows, data_cfg, rate=0.0)  # careful: every answer is the result
        return train_and_save(model, tok, seqs, trained, out, steps, batch_size, lr, log_every)


def main(argv: list[str] | None = None) -> int:
    return builder_main(argv, "Build the distillation demo's teacher.", build, packaged_path(), STEPS,
                        BATCH_SIZE, LR)


if __name__ == "__main__":
    raise SystemExit(main())
