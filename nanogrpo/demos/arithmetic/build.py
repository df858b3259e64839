"""The embedded model's warm start: a short supervised stage on the arithmetic task.

GRPO learns only from groups whose rewards differ, so a random-init model (all
answers wrong, every group flat) never starts. A few hundred supervised steps
on worked solutions teach the format and the arithmetic. The solutions imitate
a *careless* solver: the ``<think>`` part always holds the right equation, but
in ``CARELESS_RATE`` of them the ``<answer>`` copies the question's first number
instead of the result::

    <think>23+4=27</think><answer>27</answer>     (careful)
    <think>23+4=27</think><answer>23</answer>     (careless)

So the warm start can compute but, decoding greedily, mostly writes the wrong
answer: its accuracy starts low while the right answer is already in its
samples. That is the situation R1-Zero-style RL is for: GRPO, rewarded only for
correct and well-formatted answers, has to find and remove the habit by itself
(nothing in the reward mentions the ``<think>`` part). Fixed seed: the same
weights on every machine of the same torch build.

The result ships inside the package (``nanogrpo/demos/arithmetic/weights/``, model path
``embedded``). Rebuild it with ``python -m nanogrpo.demos.arithmetic.build --out DIR`` (about ten
minutes on 2 CPU cores); :func:`embedded_path` builds it into ``~/.cache/nanogrpo/`` when an install
lacks it.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import time
from pathlib import Path

import torch

from nanogrpo.config import load_config
from nanogrpo.data import build_messages, render_prompt
from nanogrpo.demos.arithmetic.task import make_split, solution
from nanogrpo.models.tiny import make_model, make_tokenizer

SHAPE = "demo"
SFT_SEED = 1234
CARELESS_RATE = 0.6
STEPS, BATCH_SIZE, LR = 600, 64, 3e-3


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships what this program builds."""
    return Path(__file__).resolve().parent / "weights"


def cache_path() -> Path:
    """Cache directory named after every setting that shapes the weights."""
    root = Path(os.environ.get("NANOGRPO_CACHE", Path.home() / ".cache" / "nanogrpo"))
    key = f"{SHAPE}-{SFT_SEED}-{CARELESS_RATE}-{STEPS}-{BATCH_SIZE}-{LR}-{torch.__version__}"
    return root / f"embedded-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def embedded_path() -> Path:
    """Directory of the embedded warm-started model, building it once if not shipped."""
    for p in (packaged_path(), cache_path()):
        if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
            return p
    out = cache_path()
    print(f"building the embedded warm-start model into {out} (once; about ten minutes)")
    build(out)
    return out


def careless_solution(sample: dict, rng: random.Random, rate: float = CARELESS_RATE) -> str:
    """The worked solution, with the answer replaced by the first operand at ``rate``."""
    text = solution(sample)
    if rng.random() < rate:
        head = text.split("<answer>")[0]
        text = f"{head}<answer>{sample['a']}</answer>"
    return text


def _encode(tok, rows, data_cfg, rate: float = CARELESS_RATE) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(SFT_SEED)
    seqs, starts = [], []
    for r in rows:
        prompt = render_prompt(tok, build_messages(r, data_cfg.system_prompt, data_cfg.few_shot), "auto")
        p = tok(prompt, add_special_tokens=False).input_ids
        c = tok(careless_solution(r, rng, rate), add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append(p + c)
        starts.append(len(p))
    return seqs, starts


def build(out: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
          log_every: int = 50) -> Path:
    """Train the warm start and save it (HF format) to ``out`` atomically."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shipped weights were built on one thread: same reduction order
    try:
        return _build(out, steps, batch_size, lr, log_every)
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, steps: int, batch_size: int, lr: float, log_every: int) -> Path:
    data_cfg = load_config(preset="demo").data
    torch.manual_seed(SFT_SEED)
    tok = make_tokenizer()
    model = make_model(SHAPE, tok, seed=SFT_SEED)
    rows = make_split("train", steps * batch_size, seed=SFT_SEED)
    seqs, starts = _encode(tok, rows, data_cfg)
    trained = [[False] * st + [True] * (len(s) - st) for s, st in zip(seqs, starts)]
    sft(model, tok.pad_token_id, seqs, trained, steps, batch_size, lr, log_every)
    return save(model, tok, out)


def sft(model, pad_id: int, seqs: list[list[int]], trained: list[list[bool]], steps: int, batch_size: int,
        lr: float, log_every: int) -> None:
    """Supervised steps over ``seqs`` in order, ``batch_size`` at a time: next-token loss on the
    positions ``trained`` marks (completions; not prompts, not tool output), AdamW with warmup and
    a cosine decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    model.train()
    t0 = time.time()
    for step in range(steps):
        scale = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        idx = range(step * batch_size, (step + 1) * batch_size)
        L = max(len(seqs[i]) for i in idx)
        ids = torch.full((batch_size, L), pad_id, dtype=torch.long)
        labels = torch.full((batch_size, L), -100, dtype=torch.long)
        for j, i in enumerate(idx):
            s = torch.tensor(seqs[i])
            ids[j, :len(s)] = s
            labels[j, :len(s)] = torch.where(torch.tensor(trained[i]), s, -100)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"warm start step {step + 1}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    model.eval()


def save(model, tok, out: Path) -> Path:
    """Save model and tokenizer (HF format) to ``out`` atomically: a temporary directory renamed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, out) if not out.exists() else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the embedded warm-start model.")
    ap.add_argument("--out", type=Path, default=packaged_path())
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    ap.add_argument("--lr", type=float, default=LR)
    a = ap.parse_args(argv)
    build(a.out, a.steps, a.batch_size, a.lr)
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
