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

import hashlib
import os
import random
from pathlib import Path

import torch

from nanogrpo.config import load_config
from nanogrpo.data import build_messages, render_prompt
from nanogrpo.demos.arithmetic.task import make_split, solution
from nanogrpo.demos.warm_start import builder_main, one_thread, train_and_save
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


def encode_solutions(tok, rows: list[dict], data_cfg, rate: float = CARELESS_RATE
                     ) -> tuple[list[list[int]], list[list[bool]]]:
    """Each row's prompt (the demo's chat template and system prompt) and worked solution (careless at
    ``rate``, seeded) as token ids with EOS, and which positions are learnt (the solution's)."""
    rng = random.Random(SFT_SEED)
    seqs, trained = [], []
    for r in rows:
        prompt = render_prompt(tok, build_messages(r, data_cfg.system_prompt, data_cfg.few_shot), "auto")
        p = tok(prompt, add_special_tokens=False).input_ids
        c = tok(careless_solution(r, rng, rate), add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append(p + c)
        trained.append([False] * len(p) + [True] * len(c))
    return seqs, trained


def build(out: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
          log_every: int = 50) -> Path:
    """Train the warm start and save it (HF format) to ``out`` atomically."""
    with one_thread():  # the shipped weights were built on one thread: same reduction order
        data_cfg = load_config(preset="demo").data
        torch.manual_seed(SFT_SEED)
        tok = make_tokenizer()
        model = make_model(SHAPE, tok, seed=SFT_SEED)
        rows = make_split("train", steps * batch_size, seed=SFT_SEED)
        seqs, trained = encode_solutions(tok, rows, data_cfg)
        return train_and_save(model, tok, seqs, trained, out, steps, batch_size, lr, log_every)


def main(argv: list[str] | None = None) -> int:
    return builder_main(argv, "Build the embedded warm-start model.", build, packaged_path(), STEPS,
                        BATCH_SIZE, LR)


if __name__ == "__main__":
    raise SystemExit(main())
