"""The tool demo's warm start: the embedded model's shape, taught to solve multi-digit problems
sometimes with the Python tool and sometimes in its head.

Supervised data (:mod:`nanogrpo.demos.tools.task`), every solution correct, ``TOOL_RATE`` of them
with the tool::

    <think><code>print(37*48)</code><output>\\n1776\\n</output>\\n</think><answer>1776</answer>
    <think>37*48=1776</think><answer>1776</answer>

The ``<output>`` part is what the sandbox answers in a real rollout, tokenised the same way
(the protocol's text around the output, each piece on its own) and, as in GRPO, not trained on.
The model learns both habits; in its head it gets most products and many sums wrong (0.8M
parameters), with the tool nearly all right. So its accuracy starts low and the right move is
already among its samples: GRPO, rewarded only for correct and well-formatted answers, should
learn to reach for the tool. ``--no-tools`` builds the comparison: the same budget (steps, batch,
learning rate, problems), every solution in the head.

Shipped in ``nanogrpo/demos/tools/weights/`` (model path ``embedded-tools``); rebuild with
``python -m nanogrpo.demos.tools.build [--no-tools] --out DIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
from pathlib import Path

import torch

from nanogrpo.config import load_config
from nanogrpo.data import build_messages, render_prompt
from nanogrpo.demos.arithmetic.build import SHAPE
from nanogrpo.demos.tools.task import make_split
from nanogrpo.demos.warm_start import one_thread, train_and_save
from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.tools.protocols import CodeProtocol

SEED = 4321
TOOL_RATE = 0.3
STEPS, BATCH_SIZE, LR = 600, 64, 3e-3
PRESET = "demo-tools"


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships what this program builds."""
    return Path(__file__).resolve().parent / "weights"


def embedded_path() -> Path:
    """Directory of the shipped tool warm start, building it into the cache once if it is missing."""
    p = packaged_path()
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        return p
    root = Path(os.environ.get("NANOGRPO_CACHE", Path.home() / ".cache" / "nanogrpo"))
    key = f"{SHAPE}-{SEED}-{TOOL_RATE}-{STEPS}-{BATCH_SIZE}-{LR}-{torch.__version__}"
    out = root / f"embedded-tools-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (out / "model.safetensors").is_file():
        print(f"building the tool demo's warm start into {out} (once; about fifteen minutes)")
        build(out)
    return out


def solution_pieces(sample: dict, use_tool: bool) -> list[tuple[str, bool]]:
    """The worked solution as ``(text, trained)`` pieces; the tool's output is not trained on."""
    result = str(sample["answer"])
    if not use_tool:
        return [(f"<think>{sample['equation']}</think><answer>{result}</answer>", True)]
    p = CodeProtocol()
    return [(f"<think><code>{sample['code']}</code>", True), (p.before_output, False), (result, False),
            (p.after_output, False), (f"</think><answer>{result}</answer>", True)]


def encode(tok, rows: list[dict], data_cfg, tool_rate: float, seed: int = SEED
           ) -> tuple[list[list[int]], list[list[bool]]]:
    rng = random.Random(seed)
    seqs, trained = [], []
    for r in rows:
        prompt = render_prompt(tok, build_messages(r, data_cfg.system_prompt, data_cfg.few_shot), "auto")
        ids = tok(prompt, add_special_tokens=False).input_ids
        mask = [False] * len(ids)
        for text, train in solution_pieces(r, rng.random() < tool_rate) + [(tok.eos_token, True)]:
            piece = tok(text, add_special_tokens=False).input_ids
            ids += piece
            mask += [train] * len(piece)
        seqs.append(ids)
        trained.append(mask)
    return seqs, trained


def build(out: Path, tools: bool = True, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
          log_every: int = 50) -> Path:
    """Train the warm start (with tool solutions, or ``tools=False`` for the comparison) and save it."""
    with one_thread():  # one thread: the same reduction order, the same weights, on every run
        data_cfg = load_config(preset=PRESET).data
        torch.manual_seed(SEED)
        tok = make_tokenizer()
        model = make_model(SHAPE, tok, seed=SEED)
        rows = make_split("train", steps * batch_size, seed=SEED)
        seqs, trained = encode(tok, rows, data_cfg, TOOL_RATE if tools else 0.0)
        return train_and_save(model, tok, seqs, trained, out, steps, batch_size, lr, log_every, replace=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the tool demo's warm start.")
    ap.add_argument("--out", type=Path, default=packaged_path())
    ap.add_argument("--no-tools", action="store_true", help="the comparison: every solution in the head")
    ap.add_argument("--steps", type=int, default=STEPS)
    a = ap.parse_args(argv)
    build(a.out, tools=not a.no_tools, steps=a.steps)
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
