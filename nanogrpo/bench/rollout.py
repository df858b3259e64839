"""``nanogrpo bench rollout``: generation speed of the rollout engines, side by side.

Builds a random-init model of a named shape offline, samples ``batch`` sequences of
``new-tokens`` tokens (forced to full length) from random ``prompt-len``-token prompts
with each engine, and prints one JSON line per engine: first call, median of the
timed repeats (warm-up excluded), tokens/s, ms per decode step, peak GPU memory, and
on the CPU the median process CPU time of a call (``cpu_median_s``: on a shared
machine the wall time also counts the other processes' turns).

Engines: ``fast``, ``hf`` (our reference engine, ``generate`` + log-probs), ``vllm`` (vLLM in this
process, ``pip install -e ".[vllm]"``), ``trl``
(``generate`` called as TRL's GRPOTrainer does: dynamic cache, no log-probs), and fast
variants for ablations: ``fast-nofuse``, ``fast-nocompile``, ``fast-eager`` (no graphs,
no compile), ``fast-torchlinear`` / ``fast-onednn`` (on the CPU: PyTorch's or oneDNN's float32
GEMMs; ``fast`` takes whichever ``model.cpu_linear=auto`` times faster on this CPU, see
``nanogrpo.models.cpu_linear``; ``hf`` and ``trl`` here PyTorch's).

    python -m nanogrpo.bench.rollout --shape qwen2.5-0.5b --batch 64 --prompt-len 128 \\
        --new-tokens 256 --engines fast,hf --trl
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from nanogrpo.engines.base import SamplingParams

FAST_VARIANTS = {"fast": {}, "fast-nofuse": {"fuse": False}, "fast-nocompile": {"compile": False},
                 "fast-eager": {"compile": False, "cuda_graphs": False},
                 "fast-torchlinear": {"cpu_linear": False}, "fast-onednn": {"cpu_linear": True}}
ENGINES = (*FAST_VARIANTS, "hf", "trl", "vllm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanogrpo bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", help="model shape from nanogrpo.models.tiny.SHAPES")
    p.add_argument("--batch", type=int, default=64, help="sequences per generate call (prompts x n)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (the prompts share a prefill)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--engines", default="fast,hf", help=f"comma-separated: {', '.join(ENGINES)}")
    p.add_argument("--trl", action="store_true", help="add the TRL-style generate call ('trl')")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu) | bf16 | fp16 | fp32")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after one warm-up call")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="instead of timing: log-prob agreement with a forward pass, greedy agreement "
                        "with model.generate (first 16 sequences)")
    a = p.parse_args(argv)
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if a.trl and "trl" not in a.engines:
        a.engines.append("trl")
    unknown = [e for e in a.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if a.batch % a.n:
        p.error(f"--batch {a.batch} is not a multiple of --n {a.n}")
    return a


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
    if name not in table:
        raise SystemExit(f"unknown --dtype {name!r}; use auto, bf16, fp16 or fp32")
    return table[name]


class _TRLStyle:
    """``model.generate`` as TRL's GRPOTrainer calls it (no vLLM): sampling, dynamic cache,
    ``min_new_tokens`` to force full length, no scores kept."""

    name = "trl"

    def __init__(self, model, tokenizer):
        self.model, self.tok = model, tokenizer

    @torch.no_grad()
    def generate(self, prompts, params):
        from nanogrpo.engines.hf import left_pad

        dev = next(self.model.parameters()).device
        ids, mask = left_pad([p for p in prompts for _ in range(params.n)], self.tok.pad_token_id, dev)
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                  temperature=params.temperature, top_p=1.0, top_k=0,
                                  max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens,
                                  pad_token_id=self.tok.pad_token_id)
        return out


def _engine(name: str, model, tok, max_len: int = 0, batch: int = 0):
    if name == "vllm":  # vLLM in this process over a copy of the weights (nanogrpo.engines.vllm_inprocess)
        from nanogrpo.engines.vllm_inprocess import VLLMEngine

        return VLLMEngine(model, tokenizer=tok, ignore_eos=True, max_model_len=max_len, max_batch=batch)
    if name in FAST_VARIANTS:
        from nanogrpo.engines.fast import FastEngine

        return FastEngine(model, tokenizer=tok, ignore_eos=True, **FAST_VARIANTS[name])
    if name == "hf":
        from nanogrpo.engines.hf import HFEngine

        return HFEngine(model, tokenizer=tok, ignore_eos=True)
    return _TRLStyle(model, tok)


def measure(name: str, model, tok, prompts, params, repeats: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    engine = _engine(name, model, tok, len(prompts[0]) + params.max_new_tokens, len(prompts) * params.n)
    times, cpu = [], []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t, c = time.perf_counter(), time.process_time()
        engine.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    med = statistics.median(times[1:]) if repeats else times[0]
    n_tok = len(prompts) * params.n * params.max_new_tokens
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    del engine
    return {"first_s": round(times[0], 3), "median_s": round(med, 4), "tok_per_s": round(n_tok / med, 1),
            "ms_per_decode_step": round(1000 * med / params.max_new_tokens, 3),
            "peak_mem_gib": None if peak is None else round(peak, 2),
            "cpu_median_s": None if cuda else round(statistics.median(cpu[1:] or cpu), 4),
            "times_s": [round(t, 4) for t in times[1:]]}


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.no_grad()
def check(name: str, model, tok, prompts, params) -> dict:
    """Sampled-token log-probs vs ``log_softmax`` of one forward pass over prompt + completion
    (max / mean abs difference), and the mean share of greedy tokens equal to ``model.generate``'s
    before the first difference (1.0 = identical)."""
    from nanogrpo.engines.hf import left_pad

    prompts = prompts[:16]
    engine = _engine(name, model, tok, len(prompts[0]) + params.max_new_tokens, len(prompts))
    gen = engine.generate(prompts, SamplingParams(params.max_new_tokens, temperature=1.0, seed=params.seed))
    worst, total, count = 0.0, 0.0, 0
    for prompt, comp, lps in zip(prompts, gen.completion_ids, gen.logprobs, strict=True):
        ids = torch.tensor([prompt + comp], device=next(model.parameters()).device)
        ref = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
        diff = (ref.gather(1, ids[0, len(prompt):, None])[:, 0].cpu() - torch.tensor(lps)).abs()
        worst, total, count = max(worst, diff.max().item()), total + diff.sum().item(), count + diff.numel()
    greedy = engine.generate(prompts, SamplingParams(params.max_new_tokens, temperature=0.0))
    ids, mask = left_pad(prompts, tok.pad_token_id, next(model.parameters()).device)
    want = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=tok.pad_token_id,
                          max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens)
    want = want[:, ids.shape[1]:].tolist()
    share = statistics.mean(_prefix(a, b) / params.max_new_tokens
                            for a, b in zip(greedy.completion_ids, want, strict=True))
    return {"check": "logprobs", "logprob_max_abs_diff": round(worst, 5),
            "logprob_mean_abs_diff": round(total / max(count, 1), 6), "tokens": count,
            "greedy_prefix_share": round(share, 3)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from nanogrpo.models.tiny import make_model, make_tokenizer

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if a.device == "auto" else a.device)
    dtype = _dtype(a.dtype, device)
    tok = make_tokenizer()
    model = make_model(a.shape, tok, seed=a.seed, dtype=dtype, device=device).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(a.seed)
    n_prompts = a.batch // a.n
    prompts = torch.randint(10, min(vocab, 90), (n_prompts, a.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=a.temperature, n=a.n, seed=a.seed)
    import transformers

    common = {"shape": a.shape, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "batch": a.batch, "n": a.n, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
              "repeats": a.repeats,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "date": datetime.date.today().isoformat()}
    status = 0
    for name in a.engines:
        try:
            if a.check:
                if name == "trl":
                    continue  # returns no log-probs
                row = {"engine": name, **common, **check(name, model, tok, prompts, params)}
            else:
                got = measure(name, model, tok, prompts, params, a.repeats, device)
                row = {"engine": name, **common, **got}
        except Exception as e:  # report and go on to the next engine
            row = {"engine": name, **common, "error": repr(e)[:400]}
            status = 1
        print(json.dumps(row), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
