"""Distributed backends on CPU (gloo): one update step on 2 ranks == the single-process step.

Each test launches ``tests/dist_worker.py`` with the standard launcher (``torchrun`` or
``deepspeed``) and compares the gathered weights with a single-process step on the whole
batch, then loads the checkpoint the 2 ranks saved in this process and checks its outputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanogrpo.models.tiny import make_model, make_tokenizer
from nanogrpo.training.distributed import make_backend
from nanogrpo.training.step import policy_update

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import make_batch, make_cfg, make_distill  # noqa: E402

WORKER = Path(__file__).parent / "dist_worker.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_step():
    tok = make_tokenizer()
    model = make_model("tiny", tok, seed=0)
    cfg = make_cfg("single")
    be = make_backend(cfg, model)
    batch = make_batch(len(tok))
    res = policy_update(be, batch, cfg, on_policy=True, terms=make_distill(cfg, tok, batch))
    return model, res


LAUNCH_TIMEOUT = 300  # s per launcher run (the ops are built beforehand, see _deepspeed_ops)


def _env() -> dict[str, str]:
    # The venv's bin first: the launcher, and the `ninja` torch JIT-builds DeepSpeed's ops with. Two
    # ninjas (pip's 1.13 in the venv, the system's 1.11) hash build commands differently, so switching
    # between them rebuilds cpu_adam (minutes) on every run.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(Path(__file__).parents[1]), "PYTHONFAULTHANDLER": "1"}  # stacks on abort


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """``cmd`` in its own process group; past ``timeout`` the whole group (launcher, ranks,
    compilers) is killed and the test fails instead of blocking."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} timed out after {timeout:.0f} s:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.fixture(scope="module")
def _deepspeed_ops():
    """Build (or load) DeepSpeed's CPU ops once, in one process, before any launcher run: built
    under the launcher, every rank waits on torch's build lock, and a rank killed mid-build leaves
    a stale ``lock`` file on which every later run waits forever, idle."""
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "from deepspeed.ops.op_builder import CPUAdamBuilder\n"
            "CPUAdamBuilder().load()\n"
            "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "b is not None and b.is_compatible() and b.load()\n")
    out = _run([sys.executable, "-c", code], timeout=1500, env=_env())
    assert out.returncode == 0, out.stdout[-3000:]


def _launch(tmp_path: Path, backend: str, stage: int = 2) -> dict:
    env = {**_env(), **({"NANOGRPO_TEST_ALGO": os.environ["NANOGRPO_TEST_ALGO"]}
                        if "NANOGRPO_TEST_ALGO" in os.environ else {})}
    # on a hang, each rank dumps its stacks and exits shortly before the launcher is killed
    env["NANOGRPO_HANG_DUMP"] = str(LAUNCH_TIMEOUT - 20)
    if backend == "deepspeed":
        ds = str(Path(sys.executable).parent / "deepspeed")
        ds = ds if Path(ds).is_file() else shutil.which("deepspeed")
        cmd = [ds, "--num_gpus", "2", "--master_port", str(_port()), str(WORKER)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_port()), str(WORKER)]
    cmd += ["--backend", backend, "--stage", str(stage), "--out", str(tmp_path)]
    out = _run(cmd, LAUNCH_TIMEOUT, env=env)
    hint = ("\n(ranks waiting in file_baton.wait: a stale torch_extensions build lock; remove it)"
            if "file_baton" in out.stdout else "")
    assert out.returncode == 0 and (tmp_path / "result.json").is_file(), out.stdout[-6000:] + hint
    return json.loads((tmp_path / "result.json").read_text())


def _check(tmp_path: Path, res: dict, atol: float = 5e-5) -> None:
    # atol: Adam's first step moves each weight by lr * g / (|g| + eps), about lr (1e-3) for every
    # element; where |g| is within a few orders of eps, the ranks' different reduction order
    # (rounding at 1e-7 relative) shifts that step by up to ~1% of lr (1.06e-5 seen with fsdp2).
    # 5e-5 still fails on any wrong update, which moves an element by ~lr or more.
    model, single = _single_step()
    assert res["loss"] == pytest.approx(single.loss, rel=1e-5, abs=1e-6)
    assert res["grad_norm"] == pytest.approx(single.grad_norm, rel=1e-4)
    assert res["metrics"].keys() == single.metrics.keys()          # every metric over the whole batch
    for k, v in single.metrics.items():
        assert res["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    got = load_file(str(tmp_path / "weights.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.allclose(got[k], v, atol=atol), (k, (got[k] - v).abs().max())
    # the checkpoint saved from 2 ranks loads in one process and gives the same outputs
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "step_1")
    ids = torch.randint(3, 100, (2, 11))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_two_ranks_match_single_process(tmp_path, backend):
    _check(tmp_path, _launch(tmp_path, backend))


ALGO = {"grpo": {"loss": "gspo", "top_entropy_quantile": 0.5, "entropy_coef": 0.01, "off_policy_mask_kl": 0.5,
                 "kl_is_weighted": True},
        "rollout": {"correction": "sequence_truncate", "correction_max": 2.0}}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_two_ranks_match_single_process_for_whole_batch_variants(tmp_path, monkeypatch, backend):
    """Every rank's share in the entropy quantile, the entropy bonus's token count, the sequence ratio, the
    correction stats and the metrics' minima and maxima: 2 ranks == one process (under FSDP2 the ranks'
    forwards gather parameters: the entropy pre-pass must match their counts too)."""
    monkeypatch.setenv("NANOGRPO_TEST_ALGO", json.dumps(ALGO))
    res = _launch(tmp_path, backend)
    assert "entropy_threshold" in res["metrics"] and "is_weight_max" in res["metrics"]
    _check(tmp_path, res)


@pytest.mark.slow
def test_two_ranks_match_single_process_with_a_teacher(tmp_path, monkeypatch):
    """On-policy distillation under ranks: each rank's teacher runs in its update's micro-batches (``jsd``
    over the vocabulary, under FSDP2's gathered head), the divergence's stats merged over ranks: 2 ranks ==
    one process. (One launch, ~15 s of CI: the ``sampled`` signal's teacher scores a rank's share as the
    reference model does, which the other two-rank tests cover.)"""
    distill = {"teacher": "tiny-seed-7", "signal": "jsd", "beta": 0.5}
    monkeypatch.setenv("NANOGRPO_TEST_ALGO", json.dumps({"distill": distill, "grpo": {"beta": 0.0}}))
    res = _launch(tmp_path, "fsdp2")
    assert abs(res["metrics"]["distill/reverse_kl"]) > 1e-4  # the teacher differs (tokens not sampled)
    _check(tmp_path, res)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_single_process(tmp_path, stage, _deepspeed_ops):
    # ZeRO-2/3 with the seed's config (overlap_comm, contiguous gradients, CPU AdamW offload), 2 CPU ranks
    _check(tmp_path, _launch(tmp_path, "deepspeed", stage))


def test_token_budget_micro_batches_sum_to_full_batch_loss():
    tok = make_tokenizer()
    batch = make_batch(len(tok))
    losses, grads = [], []
    for size, tokens in [(100, 0), (1, 0), (3, 40), (8, 25)]:
        model = make_model("tiny", tok, seed=0)
        cfg = make_cfg("single")
        cfg.train.micro_batch_size, cfg.train.micro_batch_tokens = size, tokens
        be = make_backend(cfg, model)
        be.clip_and_step = lambda max_norm: 0.0  # keep the gradients, skip the step
        be.zero_grad = lambda: None
        res = policy_update(be, batch, cfg, on_policy=True)
        losses.append(res.loss)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for lo, g in zip(losses[1:], grads[1:]):
        assert lo == pytest.approx(losses[0], rel=1e-5)
        assert torch.allclose(g, grads[0], atol=1e-6)


def test_micro_batch_indices_respect_token_budget():
    from nanogrpo.training.micro import micro_batch_indices

    batch = make_batch(103, n=16)
    mbs = micro_batch_indices(batch, 5, 40)
    assert sorted(torch.cat(mbs).tolist()) == list(range(16))
    plen = batch.attention_mask[:, :batch.prompt_len].sum(1)
    clen = batch.completion_mask.sum(1)
    for rows in mbs:
        assert len(rows) <= 5
        assert len(rows) == 1 or len(rows) * int(plen[rows].max() + clen[rows].max()) <= 40


def test_micro_batches_keep_groups_together_when_their_prompt_is_worth_sharing():
    from nanogrpo.batch import RolloutBatch
    from nanogrpo.training.micro import _forward_tokens, micro_batch_indices

    # 3 groups of 4 rows, a 40-token prompt each, completions 2..12 tokens spread inside every group
    n, p, c = 12, 40, 12
    clens = [12, 2, 7, 4, 11, 3, 6, 5, 10, 2, 8, 9]
    cm = torch.tensor([[j < k for j in range(c)] for k in clens])
    am = torch.cat([torch.ones(n, p, dtype=torch.int8), cm.to(torch.int8)], 1)
    gid = torch.arange(n) // 4
    batch = RolloutBatch(input_ids=torch.randint(3, 50, (n, p + c)), attention_mask=am, completion_mask=cm,
                         rewards=torch.zeros(n), advantages=torch.zeros(n), group_ids=gid,
                         old_logprobs=torch.zeros(n, c), prompt_len=p, group_size=4)
    by_len = micro_batch_indices(batch, 4, share_prefix=False)
    shared = micro_batch_indices(batch, 4, share_prefix=True)
    assert all(len(set(gid[mb].tolist())) == 1 for mb in shared)       # one group, one prompt each
    assert not all(len(set(gid[mb].tolist())) == 1 for mb in by_len)
    cost = [_forward_tokens([mb.tolist() for mb in m], gid.tolist(), [p] * n, clens)
            for m in (by_len, shared)]
    assert cost[1] < cost[0]
    assert sorted(torch.cat(shared).tolist()) == list(range(n))
    # 1-token prompts: nothing worth sharing, the length order (least padding) stays
    short = RolloutBatch(input_ids=batch.input_ids[:, p - 1:], attention_mask=am[:, p - 1:],
                         completion_mask=cm, rewards=torch.zeros(n), advantages=torch.zeros(n), group_ids=gid,
                         old_logprobs=torch.zeros(n, c), prompt_len=1, group_size=4)
    assert [m.tolist() for m in micro_batch_indices(short, 4, share_prefix=True)] == \
        [m.tolist() for m in micro_batch_indices(short, 4, share_prefix=False)]


def _train_cmd(backend: str, assets: Path, out: Path, steps: int, resume: bool = False) -> list[str]:
    from tests.run_fixtures import evaluated_on

    if backend == "deepspeed":
        ds = str(Path(sys.executable).parent / "deepspeed")
        ds = ds if Path(ds).is_file() else shutil.which("deepspeed")
        launch = [ds, "--num_gpus", "2", "--master_port", str(_port()), "--module", "nanogrpo.cli"]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                  "--master_port", str(_port()), "-m", "nanogrpo.cli"]
    if resume:
        return launch + ["train", "--resume", str(out), "--steps", str(steps)]
    return launch + ["train", "--model", str(assets / "model"), "--data", str(assets / "data.jsonl"),
                     "--out", str(out), "--steps", str(steps), "--seed", "3", "data.answer_delimiter=####",
                     "data.system_prompt=''", "rollout.max_new_tokens=8", "rollout.prompts_per_step=2",
                     "grpo.group_size=4", "rewards.workers=0", "train.lr=1e-2", "train.save_every=2",
                     "rewards.functions=['tests.reward_fixtures:length']", f"train.backend={backend}",
                     "train.zero_stage=2", f"train.optimizer_offload={backend == 'deepspeed'}",
                     "log.tensorboard=false", evaluated_on(assets / "data.jsonl"),
                     # pinned: each fresh process times oneDNN against torch (model.cpu_linear=auto), and two
                     # runs compared exactly must not decide differently (CI saw one pick each)
                     "model.cpu_linear=torch"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "deepspeed"])
def test_two_rank_run_resumes_exactly_on_its_backend(tmp_path, backend, request):
    """4 steps straight == 2 steps + ``--resume`` to 4, on 2 ranks of the same backend."""
    from tests.run_fixtures import comparable_metrics, write_tiny_run_assets

    if backend == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed not installed")
        request.getfixturevalue("_deepspeed_ops")
    assets = write_tiny_run_assets(tmp_path)
    root = str(Path(__file__).resolve().parents[1])
    for cmd in (_train_cmd(backend, assets, tmp_path / "straight", 4),
                _train_cmd(backend, assets, tmp_path / "halves", 2),
                _train_cmd(backend, assets, tmp_path / "halves", 4, resume=True)):
        out = _run(cmd, LAUNCH_TIMEOUT, env=_env(), cwd=root)
        assert out.returncode == 0, out.stdout[-6000:]

    def rows(run):  # the halves run also evaluates at its own last step (2)
        return comparable_metrics(tmp_path / run, drop_eval=True)

    straight = rows("straight")
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4]  # step 0: the held-out baseline
    assert sum(r.get("loss") is not None for r in straight) >= 2, "the test needs steps that update the model"
    assert rows("halves") == straight


@pytest.mark.slow
@pytest.mark.parametrize("algo", [[], ["grpo.advantage=batch_std", "grpo.top_entropy_quantile=0.5",
                                       "grpo.entropy_target=9", "grpo.entropy_coef=0.01"]],
                         ids=["default", "batch_level"])
def test_two_rank_training_run_logs_once_with_whole_batch_metrics(tmp_path, algo):
    """``nanogrpo train`` under torchrun: one metrics file written by rank 0, figures over both ranks
    (with batch-level advantages and the entropy quantile, the ranks meet in those collectives too)."""
    from nanogrpo.training.metrics import read_metrics
    from tests.run_fixtures import evaluated_on, write_tiny_run_assets

    write_tiny_run_assets(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_port()), "-m", "nanogrpo.cli", "train", "--model", str(tmp_path / "model"),
           "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "run"), "--steps", "3",
           "data.answer_delimiter=####", "data.system_prompt=''", "rollout.max_new_tokens=8",
           "rollout.prompts_per_step=2", "grpo.group_size=4", "rewards.workers=0",
           "rewards.functions=['tests.reward_fixtures:length']", "train.backend=ddp", "eval.every=3",
           "eval.n=2", evaluated_on(tmp_path / "data.jsonl"), *algo]
    out = _run(cmd, LAUNCH_TIMEOUT, env=_env(), cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stdout[-6000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]                # one writer, not one per rank
    assert rows[0]["eval/n"] == 2                                   # the held-out baseline at step 0
    assert all(r["num_completions"] == 8 and r["completion_tokens"] == 64 for r in rows[1:])  # both ranks
    assert rows[-1]["eval/n"] == 2
    assert out.stdout.count("run directory:") == 1 and out.stdout.count("nanogrpo: 3 steps") == 1


@pytest.mark.slow
def test_backend_bench_runs_one_process_on_cpu(tmp_path):
    """bench/backend_step.py (the GPU bench of every backend) runs on the CPU and reports a step."""
    env = {**_env(), "OUT": str(tmp_path)}
    out = _run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "backend_step.py"),
                "--backend", "single", "--shape", "tiny", "--rows", "8", "--len", "8", "--prompt", "4",
                "--steps", "2"], 120, env=env)
    assert out.returncode == 0, out.stdout[-3000:]
    row = json.loads((tmp_path / "backend_step.jsonl").read_text().splitlines()[-1])
    assert row["backend"] == "single" and len(row["loss"]) == 2 and row["step_s_median"] > 0
