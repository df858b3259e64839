"""The truncated-support bias (TRL issue #6789), measured: the on-policy importance ratio with and without it.

With tempered log-probs and top-k / top-p, the engine's behaviour log-probs are those of the distribution it
samples from: ``logits / T`` over the kept tokens, renormalised (vLLM's ``processed_logprobs``; nanogrpo's
engines with ``support_logprobs``). On the *same* weights (on-policy, where the ratio should be 1) this
compares them, token by token, with

- ``without``: the trainer's log-probs over the whole vocabulary (TRL's, and any trainer that does not
  apply the sampler's support): the ratio is the kept mass of each position, below 1;
- ``with``: nanogrpo's trainer log-probs over the same support (``rollout.logprob_support()``).

The model is the embedded demo's (warm-started; ``--model small``: a random-init one, whose flat
distributions stand for the high-entropy tokens of a real model), the prompts the demo's held-out
problems, G samples each.
Prints one JSON line per (engine, setting): the token ratio's mean, standard deviation, min, max, the share
of tokens the PPO clip (0.8, 1.2) would treat as off-policy, and the sequence ratio's mean (product over
the completion's tokens).

    python bench/support_ratio.py --engine fast                        # (also: hf, and vllm in its venv)
    python bench/support_ratio.py --engine vllm --settings "0.7,0,0.9"
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stats(log_ratio: torch.Tensor, cm: torch.Tensor) -> dict[str, float]:
    r = torch.exp(log_ratio[cm].double())                                          # (tokens,)
    seq = torch.exp((log_ratio.double() * cm).sum(1))                              # (rows,)
    outside = ((r < 0.8) | (r > 1.2)).float().mean().item()
    return {"mean": round(r.mean().item(), 5), "std": round(r.std().item(), 5),
            "min": round(r.min().item(), 5), "max": round(r.max().item(), 5),
            "outside_clip": round(outside, 4), "seq_mean": round(seq.mean().item(), 5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="fast", help="fast | hf | vllm")
    ap.add_argument("--settings", default="1.0,0,0.9;0.7,0,0.9;1.0,20,1.0;0.7,50,0.95",
                    help="T,top_k,top_p;... sampling settings")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=56)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="demo", help="demo (the warm-started embedded model, peaked: entropy "
                    "~0.05 nats) or a random-init shape of nanogrpo.models.tiny (e.g. small: a flat one)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from nanogrpo.algo.logprobs import token_logprobs
    from nanogrpo.config import load_config
    from nanogrpo.data import encode_prompts, load_rows
    from nanogrpo.engines import SamplingParams, make_engine
    from nanogrpo.models.load import load_policy
    from nanogrpo.rollout.collect import pad_batch

    cfg = load_config(preset="demo", overrides=["model.cpu_linear=torch"])
    model, tok, _ = load_policy(cfg.model)
    if a.model != "demo":
        from nanogrpo.models.tiny import make_model

        model = make_model(a.model, tok, seed=0)
    model.eval()
    prompts, _ = encode_prompts(tok, load_rows(cfg.data, "test")[:a.prompts], cfg.data)
    kw = {"max_model_len": 512, "max_batch": a.prompts * a.gens, "tempered_logprobs": True} \
        if a.engine == "vllm" else {}
    engine = make_engine(a.engine, model, tok, **kw)
    for item in a.settings.split(";"):
        t, k, p = item.split(",")
        t, k, p = float(t), int(k), float(p)
        params = SamplingParams(max_new_tokens=a.max_new, temperature=t, top_k=k, top_p=p, n=a.gens, seed=0,
                                logprob_temperature=t, support_logprobs=True)
        gen = engine.generate(prompts, params)
        ids, am, cm, behaviour, plen = pad_batch([x for x in prompts for _ in range(a.gens)],
                                                 gen.completion_ids, gen.logprobs, tok.pad_token_id)
        with torch.no_grad():
            whole = token_logprobs(model, ids, am.long(), plen, cm, temperature=t)
            same = token_logprobs(model, ids, am.long(), plen, cm, temperature=t, support=(k, p))
        line = {"engine": a.engine, "model": a.model, "temperature": t, "top_k": k, "top_p": p,
                "tokens": int(cm.sum()), "without": _stats(whole - behaviour, cm),
                "with": _stats(same - behaviour, cm), "date": datetime.date.today().isoformat(),
                "machine": f"{platform.machine()} {platform.processor()}"}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
