"""The MoE demo's warm start: the arithmetic demo's careless solver, as a small mixture of experts.

The model is a ``Qwen3MoeForCausalLM`` (the architecture of Qwen3-30B-A3B, at toy size: :data:`CONFIG`):
4 decoder layers, each with a router over 8 experts of which it picks 2 per token, the character-level
tokenizer of :mod:`nanogrpo.models.tiny`; about 1.0M parameters, of which about 0.4M are active per token.
It is taught exactly what the default demo's warm start is taught (:mod:`nanogrpo.demos.arithmetic.build`:
worked solutions of training problems, the ``<answer>`` the question's first number in 60% of them), so
greedy decoding is mostly wrong while the right answer is in its samples: GRPO has something to find.
On the 200 held-out problems of the demo's evaluation it answers 18.5% right (greedy) while its ``<think>``
holds the right equation and result in 90.5% of them (2026-12-05).

One difference from the dense warm start: the router is trained with the auxiliary load-balancing loss
(``output_router_logits``, weight :data:`AUX_LOSS`), as MoE pretraining does, so that every expert gets
tokens and routes differ from token to token (a router that sent everything to two experts would leave
routing replay nothing to do). The saved config turns it off again: nanogrpo trains no auxiliary loss.

Shipped in ``nanogrpo/demos/moe/weights/`` (model path ``embedded-moe``); rebuild with
``python -m nanogrpo.demos.moe.build --out DIR`` (2026-12-05: 9.6 minutes of wall, 465 s of CPU on one
thread of the shared 2-core Xeon, load 1-3; a second build wrote the same bytes). One thread and
fixed seeds: the same weights on every machine of the same torch build.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from nanogrpo.config import load_config
from nanogrpo.demos.arithmetic.build import encode_solutions
from nanogrpo.demos.arithmetic.task import make_split
from nanogrpo.demos.warm_start import builder_main, one_thread, save, sft
from nanogrpo.models.tiny import make_tokenizer

SEED = 2468
"""The warm start's training problems and initialisation (the dense demo's are 1234)."""
STEPS, BATCH_SIZE, LR = 600, 64, 3e-3
AUX_LOSS = 0.01
"""Weight of the load-balancing loss during the warm start (transformers' default is 0.001)."""
CONFIG = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
              intermediate_size=384, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
              max_position_embeddings=4096)
"""The model's shape; ``intermediate_size`` is unused (every layer is sparse: ``decoder_sparse_step`` 1)."""


def packaged_path() -> Path:
    """This folder's ``weights/``: where the package ships what this program builds."""
    return Path(__file__).resolve().parent / "weights"


def make_moe_model(tok, seed: int = SEED) -> Qwen3MoeForCausalLM:
    """The random-init model of :data:`CONFIG` for ``tok``'s vocabulary (deterministic for a seed)."""
    cfg = Qwen3MoeConfig(**CONFIG, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(cfg)


def build(out: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, lr: float = LR,
          log_every: int = 50) -> Path:
    """Train the warm start and save it (HF format) to ``out`` atomically."""
    with one_thread():  # one reduction order: the same weights on every run
        data_cfg = load_config(preset="demo").data
        torch.manual_seed(SEED)
        tok = make_tokenizer()
        model = make_moe_model(tok)
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, AUX_LOSS
        rows = make_split("train", steps * batch_size, seed=SEED)
        seqs, trained = encode_solutions(tok, rows, data_cfg)
        sft(model, tok.pad_token_id, seqs, trained, steps, batch_size, lr, log_every)
        model.config.output_router_logits = False  # the trainer trains no auxiliary loss
        return save(model, tok, out, replace=True)


def main(argv: list[str] | None = None) -> int:
    return builder_main(argv, "Build the MoE demo's warm-start model.", build, packaged_path(), STEPS,
                        BATCH_SIZE, LR)


if __name__ == "__main__":
    raise SystemExit(main())
