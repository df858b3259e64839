"""One batch of the MoE demo at the weights that sampled it: the trainer's log-probs against the hf engine's,
with the engine's routes replayed (R3) and without, in float32 and bfloat16; and what recording and
replaying cost.

The shipped warm start (``embedded-moe``) samples the demo's first batch (32 training prompts x 8,
temperature 1, 56 new tokens, seed 0) on the hf engine with its routes recorded; the trainer's lean
log-prob path (``token_logprobs``, prompts shared) then scores it three ways: routing itself and
recording its own top-k (the router disagreement), and replaying the engine's routes, each with the
prompt of a group run once (prefix sharing, the loop's default) and without (what the loop runs under R3
when a group's rows were routed differently in their prompt); a forward with no hook at all is the
timing baseline. Printed: the mismatch metrics (``nanogrpo.moe.metrics``) of
each, the flipped (token, layer) pairs, the route bytes of the batch, and median wall times (of
``--repeat`` runs, one thread) of generate with and without recording and of a forward + backward with
and without replay (after one call to warm up).

    OMP_NUM_THREADS=1 python bench/moe_replay.py
    OMP_NUM_THREADS=1 python bench/moe_replay.py --dtypes bfloat16 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch

from nanogrpo.algo.logprobs import token_logprobs
from nanogrpo.config import load_config
from nanogrpo.data import build_messages, load_rows, render_prompt
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.hf import HFEngine
from nanogrpo.models.load import load_model, load_tokenizer
from nanogrpo.models.source import resolve_model_path
from nanogrpo.moe import (
    batch_routes,
    mismatch_metrics,
    mismatch_sums,
    moe_spec,
    record_routes,
    replay_routes,
    router_disagreement,
)
from nanogrpo.moe.routes import prompts_share_routes
from nanogrpo.rollout.collect import pad_batch


def _timed(fn, repeat: int):
    """``fn()``'s result and its median wall time over ``repeat`` calls, after one call to warm up."""
    out, times = fn(), []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def one_dtype(dtype: str, repeat: int) -> None:
    cfg = load_config(preset="demo-moe")
    path = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(path)
    model = load_model(path, getattr(torch, dtype), torch.device("cpu"), cpu_linear="torch")
    spec = moe_spec(model)
    rows = load_rows(cfg.data, "train")[:cfg.rollout.prompts_per_step]
    prompts = [tok(render_prompt(tok, build_messages(r, cfg.data.system_prompt, cfg.data.few_shot), "auto"),
                   add_special_tokens=False).input_ids for r in rows]
    n = cfg.grpo.group_size
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            n=n, seed=0)
    plain_engine, engine = HFEngine(model, tokenizer=tok), HFEngine(model, tokenizer=tok, record_routes=True)
    _, t_gen = _timed(lambda: plain_engine.generate(prompts, params), repeat)
    gen, t_rec = _timed(lambda: engine.generate(prompts, params), repeat)
    ids, am, cm, beh, p = pad_batch([q for q in prompts for _ in range(n)], gen.completion_ids, gen.logprobs,
                                    tok.pad_token_id)
    routes = batch_routes(gen.routes, am, p, spec)
    model.train()  # the trainer's mode (no dropout in these models)

    def lp(ctx, share: bool = True):
        with ctx:
            out = token_logprobs(model, ids, am, p, cm, share_prefix=share)
        return out

    with torch.no_grad():
        with record_routes(model, ids, am, compare=routes) as own:
            plain = token_logprobs(model, ids, am, p, cm)
        rows = {"own routes (off), prompts shared": plain,
                "own routes (off), no prefix sharing": lp(nullcontext(), False),
                "engine's routes (R3), prompts shared": lp(replay_routes(model, routes, ids, am)),
                "engine's routes (R3), no prefix sharing": lp(replay_routes(model, routes, ids, am), False)}

    def step(ctx_fn):
        model.zero_grad(set_to_none=True)
        lp(ctx_fn())[cm].sum().backward()

    _, t_fb = _timed(lambda: step(nullcontext), repeat)
    _, t_fb_r3 = _timed(lambda: step(lambda: replay_routes(model, routes, ids, am)), repeat)
    flipped, compared = router_disagreement(own.routes, routes)
    tokens, size = int(cm.sum()), routes.numel() * routes.element_size()
    print(f"\n## {dtype}: {spec.describe()}; batch {tuple(ids.shape)}, {tokens} completion tokens, routes "
          f"{size} bytes in the batch ({tuple(routes.shape)} {routes.dtype})")
    print(f"flipped (token, layer) pairs without replay: {flipped} / {compared} ({flipped / compared:.3%}); "
          f"a group's rows share their prompt's routes: {prompts_share_routes(routes, ids, p)} (False: the "
          "loop runs R3 without prefix sharing)")
    print("| trainer forward | mismatch_abs | mismatch_abs_max | mismatch_kl | mismatch_ratio_out |")
    print("|---|---|---|---|---|")
    for name, t in rows.items():
        m = mismatch_metrics({k: float(v) for k, v in mismatch_sums(t, beh, cm).items()})
        print(f"| {name} | {m['mismatch_abs']:.3g} | {m['mismatch_abs_max']:.3g} | {m['mismatch_kl']:.3g} | "
              f"{m['mismatch_ratio_out']:.3g} |")
    print(f"generate: {t_gen:.2f} s, recording routes {t_rec:.2f} s ({t_rec / t_gen - 1:+.1%}); "
          f"forward + backward: {t_fb:.2f} s, replaying {t_fb_r3:.2f} s ({t_fb_r3 / t_fb - 1:+.1%}); "
          f"median of {repeat}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for d in a.dtypes.split(","):
        one_dtype(d.strip(), a.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
