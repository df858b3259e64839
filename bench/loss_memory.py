"""Peak memory of the loss path: nanogrpo's lean log-probs vs the seed's per-row full log-softmax.

The loss path starts from the backbone's last hidden states (N, L, H) and the
LM head weight (V, H), both requiring gradients, and ends after ``backward()``
of the GRPO loss (k3 KL to given reference log-probs, seed reduction). Each
variant runs in its own subprocess so one's peak cannot hide the other's:

    seed   logits = h @ W.T (N, L, V); per row log_softmax + gather (the seed's get_per_token_logps)
    lean   nanogrpo.algo.logprobs.linear_logprobs over the completion tokens, ``--chunk`` at a time

With ``--entropy value`` (what every training step now computes: the policy's per-token entropy in
the same chunked pass, for the logs) or ``--entropy grad`` (the entropy bonus: its gradient too) the
lean variant also runs with that, so the cost of the entropy in memory shows beside it.

Peak: on CUDA ``torch.cuda.max_memory_allocated`` above the inputs; on the CPU
the process's peak RSS (``ru_maxrss``) above its RSS once the inputs exist.

    python bench/loss_memory.py                       # 64 x 512 tokens, H 896, V 151936 (seed: ~45 GB)
    python bench/loss_memory.py --n 8 --device cpu    # what fits a 24 GB CPU machine
    python bench/loss_memory.py --device cpu --seed-fit 4,8,16   # 64 x 512 on a 24 GB machine
    python bench/loss_memory.py --n 8 --device cpu --lean-only --entropy value,grad   # the entropy's cost

``--seed-fit N1,N2,..``: the seed's path runs at those batch sizes only and its peak at
``--n`` is the least-squares line through them (its memory is linear in the batch: the
(N, L, V) logits and their gradient); lean always runs at ``--n`` itself.

Prints a table; with $OUT set, also writes $OUT/loss_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _grpo_loss(logp, ref, adv, beta=0.04):
    d = ref - logp                                                       # (N, C)
    kl = torch.exp(d) - d - 1
    loss_t = -(torch.exp(logp - logp.detach()) * adv[:, None] - beta * kl)
    return loss_t.mean(1).mean()


def run_variant(a) -> dict:
    from nanogrpo.algo.logprobs import linear_logprobs

    dev = torch.device(a.device)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(a.n, a.len, a.hidden, generator=g) * 0.5).to(dev, dt).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).to(dev, dt).requires_grad_()
    tgt = torch.randint(0, a.vocab, (a.n, a.len), generator=g).to(dev)
    ref = (-torch.rand(a.n, a.len, generator=g) * 10).to(dev)
    adv = torch.randn(a.n, generator=g).to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
    t0 = time.perf_counter()
    if a.variant == "seed":
        logits = h @ w.t()                                               # (N, L, V) in the model dtype
        rows = [lr.log_softmax(-1).gather(-1, tr[:, None]).squeeze(-1) for lr, tr in zip(logits, tgt)]
        logp = torch.stack(rows).float()                                 # (N, L)
    else:
        out = linear_logprobs(h.reshape(-1, a.hidden), w, None, tgt.reshape(-1), a.chunk, entropy=a.entropy)
        logp = (out if a.entropy == "none" else out[:, 0]).view(a.n, a.len)
    loss = _grpo_loss(logp, ref, adv)
    if a.variant == "lean" and a.entropy == "grad":
        loss = loss - 0.01 * out[:, 1].mean()                            # the entropy bonus
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": a.variant, "peak_bytes": int(peak), "seconds": time.perf_counter() - t0,
            "loss": float(loss), "grad_w_norm": float(w.grad.float().norm())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=64, help="completions")
    p.add_argument("--len", type=int, default=512, help="completion tokens each")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (lean)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--seed-fit", default="", help="comma-separated batch sizes: extrapolate the seed's peak")
    p.add_argument("--entropy", default="", help="comma-separated: value, grad (lean also runs with them)")
    p.add_argument("--lean-only", action="store_true", help="skip the seed's path (e.g. with --entropy)")
    p.add_argument("--variant", choices=["seed", "lean"], help=argparse.SUPPRESS)
    a = p.parse_args()
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if a.variant:
        a.entropy = a.entropy or "none"
        print(json.dumps(run_variant(a)))
        return
    def run(v: str, n: int, entropy: str = "none") -> dict:
        cmd = [sys.executable, __file__, "--variant", v, "--n", str(n), "--len", str(a.len),
               "--hidden", str(a.hidden), "--vocab", str(a.vocab), "--chunk", str(a.chunk),
               "--device", a.device, "--dtype", a.dtype, "--entropy", entropy]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            return {"variant": v, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
        return json.loads(out.stdout.strip().splitlines()[-1])

    res = {"lean": run("lean", a.n)}
    for e in [x.strip() for x in a.entropy.split(",") if x.strip()]:
        res[f"lean+H {e}"] = run("lean", a.n, e)
    fit = [int(x) for x in a.seed_fit.split(",") if x.strip()]
    if a.lean_only:
        pass
    elif len(fit) >= 2:
        pts = [(n, run("seed", n)) for n in fit]
        bad = [r for _, r in pts if "error" in r]
        if bad:
            res["seed"] = bad[0]
        else:
            xs, ys = [n for n, _ in pts], [r["peak_bytes"] for _, r in pts]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            res["seed"] = {"variant": "seed", "peak_bytes": int(my + slope * (a.n - mx)),
                           "extrapolated_from": {str(n): r["peak_bytes"] for n, r in pts}}
            for n, r in pts:
                res[f"seed@{n}"] = r
    else:
        res["seed"] = run("seed", a.n)
    shape = f"{a.n} x {a.len} tokens, H {a.hidden}, V {a.vocab}, {a.dtype} on {a.device}"
    print(f"loss-path peak memory ({shape}; lean chunk {a.chunk})")
    print(f"{'variant':14} {'peak GiB':>10} {'seconds':>9}")
    for v, r in res.items():
        if v == "seed" and "extrapolated_from" in r:
            print(f"{'seed':8} {r['peak_bytes'] / 2**30:10.3f}   (line through the seed@N rows, N = {a.n})")
            continue
        if "error" in r:
            print(f"{v:14} failed: {r['error']}")
        else:
            print(f"{v:14} {r['peak_bytes'] / 2**30:10.3f} {r['seconds']:9.2f}")
    ok = all("error" not in r for r in res.values())
    if ok and "seed" in res:
        ratio = res["lean"]["peak_bytes"] / max(res["seed"]["peak_bytes"], 1)
        diff = ("the seed's peak extrapolated" if "extrapolated_from" in res["seed"]
                else f"loss diff {abs(res['lean']['loss'] - res['seed']['loss']):.2e}")
        print(f"lean / seed = {ratio:.3f}  (1/{1 / ratio:.1f}); {diff}")
        res["ratio"] = ratio
    res["shape"] = shape
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "loss_memory.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
