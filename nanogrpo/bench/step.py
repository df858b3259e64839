"""``nanogrpo bench step``: one full GRPO step of the single-process trainer, timed.

Runs nanogrpo's own ``train_step`` (rollout with the engine, rewards, reference
log-probs with ``beta``, policy update) on a random-init model of a named shape
built offline: ``prompts`` x ``gens`` completions of exactly ``max-new`` tokens
(the engine ignores EOS) and random rewards, so that every group carries signal
and both systems do the same work. Prints one JSON line: median step time over
the steps after the first, median generation time and its share, completion
tokens/s, peak memory, every step's time.

With ``--trl`` (and ``trl`` importable) TRL's ``GRPOTrainer`` then runs in the
same process on the same shape, prompts, batch and lengths, set up as the anchor
in ``shared/anchors/trl_anchor.py`` (HF ``generate`` forced to full length with
``min_new_tokens``, gradient checkpointing, ``loss_type="grpo"``, same ``beta``,
lr and temperature); it prints its own line and a ratio line. Rewards run in-process on
both sides (``--reward-workers 0``), as TRL calls its reward functions.

On a shared CPU pass ``--threads 1`` (both systems use it): with two threads per process on
two busy cores both ran 5-20x slower, step to step, and the figures meant nothing.

    nanogrpo bench step --shape small --prompts 4 --gens 8 --max-new 64 --trl --threads 1
    nanogrpo bench step --shape qwen3-small --prompts 4 --gens 8 --max-new 64 --trl --threads 1
    nanogrpo bench step --shape qwen2.5-0.5b --prompts 8 --gens 8 --max-new 256   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import random
import resource
import statistics
import sys
import tempfile
import time

import torch

from nanogrpo.bench.rollout import _dtype

REWARD_SPEC = "nanogrpo.bench.step:random_reward"
_rng = random.Random(0)


def random_reward(completion: str, sample: dict) -> float:
    """A reward in [0, 1) that ignores its input: every group has spread, so every group trains."""
    return _rng.random()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanogrpo bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help="model shape from nanogrpo.models.tiny.SHAPES")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--gens", type=int, default=8, help="samples per prompt (group size)")
    p.add_argument("--max-new", type=int, default=64, help="new tokens per completion (forced)")
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (> 0: reference log-probs)")
    p.add_argument("--steps", type=int, default=6, help="steps per system; the first is excluded")
    p.add_argument("--engine", default="auto", help="nanogrpo rollout engine: auto | fast | hf")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="rows per forward/backward in the update (0: the whole batch, as TRL's run)")
    p.add_argument("--grad-ckpt", type=int, default=0, help="gradient checkpointing for nanogrpo (0/1)")
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (needs trl)")
    p.add_argument("--trl-grad-ckpt", type=int, default=1, help="gradient checkpointing for TRL (anchor: 1)")
    p.add_argument("--trl-only", action="store_true", help="run TRL only (implies --trl)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--cpu-linear", choices=["auto", "onednn", "torch"], default="auto",
                   help="nanogrpo's float32 CPU linears (model.cpu_linear); TRL always runs torch's")
    p.add_argument("--reward-workers", type=int, default=0,
                   help="reward worker processes (0: in-process, as TRL calls its reward functions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    a = p.parse_args(argv)
    if a.trl_only:
        a.trl = True
    if a.steps < 1 or a.prompts < 1 or a.gens < 2 or a.max_new < 1:
        p.error("need --steps >= 1, --prompts >= 1, --gens >= 2, --max-new >= 1")
    return a


def question_rows(n: int, seed: int = 0) -> list[dict]:
    """Short arithmetic questions, as the anchor's ``arithmetic_rows``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        x, y = rng.randint(1, 99), rng.randint(1, 99)
        rows.append({"id": str(i), "question": f"What is {x}+{y}?", "answer": str(x + y)})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_gpu_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
    # process-wide high-water mark (Linux: KiB), so it includes everything run before
    return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def _summary(step_times: list[float], gen_times: list[float], n_tok: int, cpu_times: list[float]) -> dict:
    steady = step_times[1:] or step_times
    cpu = statistics.median(cpu_times[1:] or cpu_times)
    gsteady = gen_times[1:] or gen_times
    step = statistics.median(steady)
    gen = statistics.median(gsteady) if gsteady else float("nan")
    return {"step_s_median": round(step, 4), "gen_s_median": round(gen, 4),
            "gen_share": round(gen / step, 3), "completion_tok_per_s": round(n_tok / step, 1),
            "gen_tok_per_s": round(n_tok / gen, 1) if gen == gen and gen > 0 else None,
            "step_cpu_s_median": round(cpu, 4)}


class _TimedEngine:
    """Wraps an engine: records each ``generate``'s wall time (synchronised)."""

    def __init__(self, engine, device: torch.device):
        self.engine, self.device, self.times = engine, device, []
        self.name = getattr(engine, "name", type(engine).__name__)

    def generate(self, prompts, params):
        _sync(self.device)
        t = time.perf_counter()
        out = self.engine.generate(prompts, params)
        _sync(self.device)
        self.times.append(time.perf_counter() - t)
        return out


def run_nanogrpo(a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """``a.steps`` calls of the trainer's own ``train_step`` on a fresh random-init model."""
    from nanogrpo.config import Config
    from nanogrpo.data import PromptSampler
    from nanogrpo.engines.factory import make_engine
    from nanogrpo.models.cpu_linear import apply_cpu_linear
    from nanogrpo.models.cpu_linear import linear as onednn_linear
    from nanogrpo.models.load import frozen_copy
    from nanogrpo.models.tiny import make_model, make_tokenizer
    from nanogrpo.rewards import reward_runner
    from nanogrpo.training.loop import train_step
    from nanogrpo.training.optim import MasterAdamW
    from nanogrpo.training.setup import local_run

    n = a.prompts * a.gens
    cfg = Config.model_validate({
        "model": {"path": "embedded", "device": str(device), "chat_template": "auto"},
        "data": {"system_prompt": ""},
        "rollout": {"engine": a.engine, "prompts_per_step": a.prompts, "max_new_tokens": a.max_new,
                    "temperature": 0.9, "top_p": 1.0, "top_k": 0},
        "grpo": {"group_size": a.gens, "beta": a.beta, "loss": "grpo", "updates_per_batch": 1},
        "rewards": {"functions": [REWARD_SPEC], "workers": a.reward_workers},
        "train": {"lr": 1e-6, "micro_batch_size": a.micro_batch or n, "seed": a.seed,
                  "gradient_checkpointing": bool(a.grad_ckpt), "steps": a.steps},
    })
    torch.manual_seed(a.seed)
    _rng.seed(a.seed)
    tok = make_tokenizer()
    model = make_model(a.shape, tok, seed=a.seed, dtype=dtype, device=device)
    train_onednn = apply_cpu_linear(model, a.cpu_linear)  # as load_model does for model.cpu_linear
    model.generation_config.pad_token_id = tok.pad_token_id
    ref = frozen_copy(model) if a.beta > 0 else None  # before the engine, as train() does
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = MasterAdamW(model.parameters(), lr=cfg.train.lr, betas=cfg.train.adam_betas,
                            weight_decay=cfg.train.weight_decay)
    engine = _TimedEngine(make_engine(a.engine, model, tok, ignore_eos=True, cpu_linear=a.cpu_linear), device)
    sampler = PromptSampler(question_rows(max(64, a.prompts * (a.steps + 2)), a.seed), a.prompts,
                            seed=a.seed, shuffle=True)
    rewards = reward_runner(cfg)
    run = local_run(cfg, model, tok, engine, rewards, sampler, ref=ref, optimizer=optimizer)
    _reset_peak(device)
    times, cpu, kept = [], [], []
    try:
        for step in range(1, a.steps + 1):
            _sync(device)
            t, c = time.perf_counter(), time.process_time()
            row = train_step(run, step)
            _sync(device)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            kept.append(row["groups_kept"])
            if row["completion_tokens"] != n * a.max_new:
                raise RuntimeError(f"step {step}: {row['completion_tokens']} completion tokens, "
                                   f"expected {n * a.max_new} (engine did not force full length)")
    finally:
        rewards.close()
    return {"system": "nanogrpo", "engine": engine.name,
            "cpu_linear": a.cpu_linear if device.type == "cpu" else None,
            "onednn": {"train": train_onednn,
                       "engine": getattr(engine.engine, "_lin", None) is onednn_linear},
            "grad_ckpt": int(cfg.train.gradient_checkpointing),
            "micro_batch": cfg.train.micro_batch_size, "updates": run.version, "groups_kept": kept,
            **_summary(times, engine.times, n * a.max_new, cpu), **_peak(device),
            "step_times": [round(x, 4) for x in times],
            "gen_times": [round(x, 4) for x in engine.times]}


def run_trl(a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """TRL's GRPOTrainer for ``a.steps`` steps, configured as the anchor (``trl_anchor.py``).

    Runs with stdout sent to stderr, imports included: TRL prints its logs, and loggers that
    its imports create (e.g. DeepSpeed's, through accelerate) keep the stdout they saw."""
    with contextlib.redirect_stdout(sys.stderr):
        return _run_trl(a, device, dtype)


def _run_trl(a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nanogrpo.models.tiny import make_model, make_tokenizer

    cuda = device.type == "cuda"
    n = a.prompts * a.gens
    torch.manual_seed(a.seed)
    _rng.seed(a.seed)
    tok = make_tokenizer()
    rows = question_rows(max(64, a.prompts * (a.steps + 2)), a.seed)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                            for r in rows])
    gen_times: list[float] = []
    step_times: list[float] = []
    step_cpu: list[float] = []
    model = make_model(a.shape, tok, seed=a.seed, dtype=dtype)
    model_class = type(model)  # Qwen2ForCausalLM or Qwen3ForCausalLM: TRL's generate calls are timed on it
    orig_generate, own = model_class.generate, "generate" in vars(model_class)

    def timed_generate(self, *args, **kw):
        _sync(device)
        t = time.perf_counter()
        out = orig_generate(self, *args, **kw)
        _sync(device)
        gen_times.append(time.perf_counter() - t)
        return out

    class StepTimer(TrainerCallback):
        t = c = 0.0

        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            step_times.append(time.perf_counter() - self.t)
            step_cpu.append(time.process_time() - self.c)

    def trl_reward(completions, **kw):
        return [_rng.random() for _ in completions]

    with tempfile.TemporaryDirectory(prefix="nanogrpo_bench_trl_") as tmp:
        model_dir = f"{tmp}/model"
        # TRL builds its reference copy from a path, as in the anchor
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        del model
        cfg = GRPOConfig(
            output_dir=f"{tmp}/out", max_steps=a.steps, per_device_train_batch_size=n,
            num_generations=a.gens, max_completion_length=a.max_new, beta=a.beta, learning_rate=1e-6,
            temperature=0.9, bf16=cuda and dtype == torch.bfloat16, use_cpu=not cuda,
            gradient_checkpointing=bool(a.trl_grad_ckpt), logging_steps=1, report_to="none",
            save_strategy="no", loss_type="grpo", generation_kwargs={"min_new_tokens": a.max_new},
            dataloader_num_workers=0, model_init_kwargs={"dtype": dtype}, disable_tqdm=True, seed=a.seed,
        )
        trainer = GRPOTrainer(model=model_dir, reward_funcs=trl_reward, args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[StepTimer()])
        _reset_peak(device)
        model_class.generate = timed_generate
        try:
            trainer.train()
        finally:
            if own:
                model_class.generate = orig_generate
            else:
                del model_class.generate  # back to the inherited one
        del trainer
    return {"system": f"trl-{trl.__version__}", "engine": "generate", "grad_ckpt": a.trl_grad_ckpt,
            "micro_batch": n, **_summary(step_times, gen_times, n * a.max_new, step_cpu), **_peak(device),
            "step_times": [round(x, 4) for x in step_times], "gen_times": [round(x, 4) for x in gen_times]}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import transformers

    if a.threads:
        torch.set_num_threads(a.threads)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if a.device == "auto" else a.device)
    dtype = _dtype(a.dtype, device)
    common = {"shape": a.shape, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "prompts": a.prompts, "gens": a.gens, "max_new": a.max_new, "beta": a.beta, "steps": a.steps,
              "threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "date": datetime.date.today().isoformat()}
    status = 0
    results: dict[str, dict] = {}

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")

    runners = [] if a.trl_only else [("nanogrpo", run_nanogrpo)]
    if a.trl:
        runners.append(("trl", run_trl))
    for key, fn in runners:
        try:
            row = {**fn(a, device, dtype), **common}
            results[key] = row
        except Exception as e:  # report and go on with the other system
            row = {"system": key, **common, "error": repr(e)[:400]}
            status = 1
        emit(row)
    if "nanogrpo" in results and "trl" in results:
        ours, theirs = results["nanogrpo"], results["trl"]
        ratio = round(theirs["step_s_median"] / ours["step_s_median"], 2)
        emit({"ratio": "trl_step / nanogrpo_step", "value": ratio,
              "cpu_time_value": round(theirs["step_cpu_s_median"] / ours["step_cpu_s_median"], 2),
              "gen_ratio": round(theirs["gen_s_median"] / ours["gen_s_median"], 2),
              "nanogrpo_step_s": ours["step_s_median"], "trl_step_s": theirs["step_s_median"], **common})
    return status


if __name__ == "__main__":
    sys.exit(main())
