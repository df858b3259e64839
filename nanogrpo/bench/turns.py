"""``nanogrpo bench turns``: multi-turn (tool) rollouts of the engines, side by side.

Runs one step's multi-turn rollout of a tool config (default: the tool demo, ``demo-tools``:
its model, prompts, ``prompts_per_step`` x ``group_size`` trajectories, ``max_new_tokens``,
``tools.max_turns``, the real sandbox) with each engine in turn, ``repeats`` times after one
warm-up round; repeat i gives every engine the same prompts and seed. One JSON line per engine:
median wall time of the rollout, of its generation part (``generate_s``: the tool calls excluded)
and of its process CPU time, tokens sampled, tool calls, the sandbox's time per call
(``tool_ms_per_call``: a step's calls go to the sandbox together, ``tools.workers`` at a time) and
tool tokens per call (the engines sample different trajectories, so these differ a little).

Engines: ``fast`` (its own session: KV cache kept across turns), ``fast-reprefill`` (the generic
session over ``fast``'s ``generate``: each turn re-runs the whole context), ``hf`` (the generic
session over ``model.generate``), ``vllm`` (generic session; prefix caching makes it cheap).

    nanogrpo bench turns --engines fast,fast-reprefill,hf --repeats 5 --threads 1
    nanogrpo bench turns --open-call '<think><code>' data.system_prompt='"..."'   # longer contexts
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

ENGINES = ("fast", "fast-reprefill", "hf", "vllm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanogrpo bench turns", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a tool config file (default: the demo-tools preset)")
    p.add_argument("--engines", default="fast,fast-reprefill,hf",
                   help=f"comma-separated: {', '.join(ENGINES)}")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is; 1 on a shared CPU)")
    p.add_argument("--open-call", default="", help="text appended to every prompt, e.g. '<think><code>': "
                   "every trajectory starts inside a tool call")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    a = p.parse_args(argv)
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    unknown = [e for e in a.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    return a


def _engine(name: str, cfg, model, tok, max_len: int):
    from nanogrpo.engines.factory import make_engine
    from nanogrpo.engines.session import WithoutSession

    if name == "vllm":
        from nanogrpo.engines.vllm_inprocess import VLLMEngine, vllm_options

        return VLLMEngine(model, tokenizer=tok, **{**vllm_options(cfg), "max_model_len": max_len})
    if name == "fast-reprefill":
        return WithoutSession(make_engine("fast", model, tok, max_len=max_len))
    return make_engine(name, model, tok, max_len=max_len)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from nanogrpo.config import load_config
    from nanogrpo.data import encode_prompts, load_rows
    from nanogrpo.engines.base import SamplingParams
    from nanogrpo.models.load import load_policy
    from nanogrpo.rollout.turns import generate_with_tools, longest_context
    from nanogrpo.tools.runner import ToolRunner

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = load_config(a.config, overrides=a.overrides) if a.config else \
        load_config(preset="demo-tools", overrides=a.overrides)
    if not cfg.tools.enabled:
        print("nanogrpo bench turns: the config has tools.enabled = false", file=sys.stderr)
        return 2
    model, tok, _ = load_policy(cfg.model)
    model.eval().requires_grad_(False)
    rows = load_rows(cfg.data, cfg.data.split)
    k = cfg.rollout.prompts_per_step
    batches = [rows[i * k:(i + 1) * k] for i in range(a.repeats + 1)]
    prompts = [encode_prompts(tok, b, cfg.data, cfg.model.chat_template)[0] for b in batches]
    opening = tok(a.open_call, add_special_tokens=False)["input_ids"] if a.open_call else []
    prompts = [[p + opening for p in ps] for ps in prompts]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, n=cfg.grpo.group_size,
                            logprob_temperature=cfg.rollout.logprob_temperature())
    max_len = longest_context(cfg, tok, cfg.rollout.max_new_tokens)
    engines = {name: _engine(name, cfg, model, tok, max_len) for name in a.engines}
    runs: dict[str, list[dict]] = {name: [] for name in a.engines}
    with ToolRunner(cfg.tools) as tools, torch.no_grad():
        for i in range(a.repeats + 1):  # round 0 warms up; every engine gets round i's prompts and seed
            for name, engine in engines.items():
                t, c = time.perf_counter(), time.process_time()
                gen = generate_with_tools(engine, tok, tools, prompts[i], batches[i],
                                          SamplingParams(**{**params.__dict__, "seed": i}),
                                          cfg.tools.max_turns, cfg.tools.max_output_tokens)
                m = gen.tool_metrics
                runs[name].append({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c,
                                   "generate_s": gen.stats["generate_s"], "tool_s": gen.stats["tool_s"],
                                   "tool_ms_per_call": 1e3 * gen.stats["tool_s"] / max(m["tools/calls"], 1),
                                   "sampled": m["tools/generated_tokens"], "calls": m["tools/calls"],
                                   "tool_tokens": m["tools/tool_tokens"]})
    common = {"config": a.config or "preset demo-tools", "overrides": a.overrides, "open_call": a.open_call,
              "model": cfg.model.path, "prompt_tokens_mean": statistics.fmean(map(len, prompts[0])),
              "trajectories": k * cfg.grpo.group_size, "max_new_tokens": cfg.rollout.max_new_tokens,
              "max_turns": cfg.tools.max_turns, "repeats": a.repeats, "threads": torch.get_num_threads(),
              "device": str(next(model.parameters()).device), "torch": torch.__version__,
              "date": datetime.date.today().isoformat()}
    for name, got in runs.items():
        timed = got[1:]
        med = {key: statistics.median(r[key] for r in timed) for key in timed[0]}
        print(json.dumps({"engine": name, **common,
                          **{f"median_{key}": round(v, 4) for key, v in med.items()},
                          "generate_s": [round(r["generate_s"], 3) for r in timed]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
