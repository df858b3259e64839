"""Float32 CPU linears through oneDNN: same outputs and gradients as ``F.linear``, switched per model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from nanogrpo.algo.logprobs import LeanHead, token_logprobs
from nanogrpo.config import Config
from nanogrpo.engines import HFEngine, SamplingParams
from nanogrpo.engines.fast import FastEngine
from nanogrpo.models import cpu_linear
from nanogrpo.models.cpu_linear import OneDnnLinear, OneDnnLinearFn, onednn_available, use_onednn_linears
from nanogrpo.models.load import load_model
from nanogrpo.models.tiny import make_model, make_tokenizer

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch build without oneDNN's linear")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_function_matches_f_linear_forward_and_backward(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, requires_grad=True)              # a (B, L, in) input, as in a model
    w = torch.randn(24, 16, requires_grad=True)
    b = torch.randn(24, requires_grad=True) if bias else None
    g = torch.randn(3, 7, 24)
    ins = [x, w] + ([b] if bias else [])
    y = OneDnnLinearFn.apply(x, w, b)
    y0 = F.linear(x, w, b)
    assert y.shape == y0.shape and torch.allclose(y, y0, atol=1e-5)
    for a, r in zip(torch.autograd.grad((y * g).sum(), ins), torch.autograd.grad((y0 * g).sum(), ins)):
        assert torch.allclose(a, r, atol=1e-4)


@needs_onednn
def test_model_switch_keeps_weights_logits_and_gradients():
    tok = make_tokenizer()
    plain = make_model("tiny", tok, seed=0)
    fast = copy.deepcopy(plain)
    n = use_onednn_linears(fast)
    assert n == 2 * (4 + 3)  # tiny: 2 layers x (q, k, v, o + gate, up, down)
    assert not isinstance(fast.lm_head, OneDnnLinear)         # the head is the lean path's to project
    assert list(fast.state_dict()) == list(plain.state_dict())
    ids = torch.randint(3, len(tok), (4, 12))
    am = torch.ones_like(ids)
    cm = torch.ones(4, 5, dtype=torch.bool)
    outs = []
    for m in (plain, fast):
        lp = token_logprobs(m, ids, am, 7, cm)
        (lp * torch.arange(20.0).view(4, 5)).sum().backward()
        outs.append((lp, {k: p.grad for k, p in m.named_parameters()}))
    assert isinstance(fast.lm_head, LeanHead)
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5)
    for k, g in outs[0][1].items():
        assert torch.allclose(g, outs[1][1][k], atol=1e-4), k


@needs_onednn
def test_non_float32_and_autocast_take_torchs_path():
    lin = torch.nn.Linear(8, 4)
    lin.__class__ = OneDnnLinear
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16                 # autocast still applies
    lin.to(torch.bfloat16)
    xb = x.bfloat16()
    assert torch.equal(lin(xb), F.linear(xb, lin.weight, lin.bias))


def test_unavailable_onednn_leaves_the_model_alone(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    m = make_model("tiny", make_tokenizer())
    assert use_onednn_linears(m) == 0
    assert not any(isinstance(x, OneDnnLinear) for x in m.modules())
    x = torch.randn(2, 3)
    w = torch.randn(4, 3)
    assert torch.equal(cpu_linear.linear(x, w), F.linear(x, w))


@needs_onednn
def test_load_model_follows_the_config(tmp_path):
    tok = make_tokenizer()
    make_model("tiny", tok).save_pretrained(tmp_path)
    cpu = torch.device("cpu")
    on = load_model(str(tmp_path), torch.float32, cpu, cpu_linear="onednn")
    off = load_model(str(tmp_path), torch.float32, cpu, cpu_linear="torch")
    assert any(isinstance(m, OneDnnLinear) for m in on.modules())
    assert not any(isinstance(m, OneDnnLinear) for m in off.modules())
    with pytest.raises(ValueError, match="cpu_linear"):
        Config.model_validate({"model": {"cpu_linear": "mkl"}})
    assert Config.model_validate({}).model.cpu_linear == "auto"


@needs_onednn
@pytest.mark.parametrize("faster", [True, False])
def test_auto_takes_what_the_timing_says_for_trainer_and_engine(tmp_path, monkeypatch, faster):
    """``auto``: the trainer's linears (many rows) and the engine's (a decode step's rows) each go
    to oneDNN exactly when it timed faster for that shape class on this CPU."""
    asked = []

    def timed(rows, k, n, threads):
        asked.append((rows, k, n))
        return faster if rows == cpu_linear.TRAIN_ROWS else not faster

    monkeypatch.setattr(cpu_linear, "onednn_faster", timed)
    tok = make_tokenizer()
    make_model("tiny", tok).save_pretrained(tmp_path)
    m = load_model(str(tmp_path), torch.float32, torch.device("cpu"), cpu_linear="auto")
    assert any(isinstance(x, OneDnnLinear) for x in m.modules()) == faster
    engine = FastEngine(m, tokenizer=tok)                      # the engine's default is auto too
    assert (engine._lin is cpu_linear.linear) == (not faster)
    assert asked == [(cpu_linear.TRAIN_ROWS, 64, 128), (cpu_linear.DECODE_ROWS, 64, 128)]  # tiny: 64, 128
    assert FastEngine(m, tokenizer=tok, cpu_linear="torch")._lin is F.linear
    with pytest.raises(ValueError, match="cpu_linear must be one of"):
        cpu_linear.choose("mkl", 32, 8, 8)


@needs_onednn
def test_onednn_faster_times_the_real_ops():
    """The timing runs both implementations on the shape it is asked about and caches per shape."""
    cpu_linear.onednn_faster.cache_clear()
    a = cpu_linear.onednn_faster(32, 48, 64, torch.get_num_threads())
    assert isinstance(a, bool)
    assert cpu_linear.onednn_faster(32, 48, 64, torch.get_num_threads()) is a
    assert cpu_linear.onednn_faster.cache_info().hits == 1


@needs_onednn
def test_fast_engine_on_onednn_matches_generate():
    tok = make_tokenizer()
    m = make_model("small", tok, seed=3)
    m.eval()
    plain = copy.deepcopy(m)                                   # torch's linears: the reference
    use_onednn_linears(m)
    engine = FastEngine(m, tokenizer=tok, cpu_linear="onednn")
    assert engine._lin is cpu_linear.linear
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    greedy = SamplingParams(n=1, max_new_tokens=12, temperature=0.0)
    ours = engine.generate(prompts, greedy)
    ref = HFEngine(plain, tokenizer=tok).generate(prompts, greedy)
    assert ours.completion_ids == ref.completion_ids and len({tuple(c) for c in ours.completion_ids}) > 1
    for lp, rlp in zip(ours.logprobs, ref.logprobs):
        assert torch.allclose(torch.tensor(lp), torch.tensor(rlp), atol=1e-4)


@needs_onednn
def test_settle_decides_once_reuses_a_record_and_lets_an_explicit_setting_win(monkeypatch, caplog):
    """A run's decisions (:func:`settle`): ``auto`` times both shape classes and applies the trainer's;
    given the decisions a checkpoint recorded it reuses them, timing nothing, even where this
    process's timing says otherwise; ``onednn`` / ``torch`` ignore the record; a record it cannot use
    (damaged, or missing the engine's) is timed again."""
    tok = make_tokenizer()
    asked = []

    def timed(rows, k, n, threads):
        asked.append(rows)
        return rows == cpu_linear.TRAIN_ROWS  # oneDNN for the trainer, torch for the decode

    def settled(setting, recorded=None, engine=True):
        m = make_model("tiny", tok)
        with caplog.at_level("INFO", logger="nanogrpo.models"):
            out = cpu_linear.settle(setting, m, recorded, engine=engine)
        assert any(isinstance(x, OneDnnLinear) for x in m.modules()) == (out.get("trainer") == "onednn")
        return out

    monkeypatch.setattr(cpu_linear, "onednn_faster", timed)
    first = settled("auto")
    assert first == {"trainer": "onednn", "engine": "torch"} and asked == [256, 32]
    assert "timed on this CPU" in caplog.text
    monkeypatch.setattr(cpu_linear, "onednn_faster", lambda *a: not timed(*a))  # now the other way
    asked.clear()
    caplog.clear()
    assert settled("auto", first) == first and asked == []        # the resumed process times nothing
    said = [r.getMessage() for r in caplog.records if "as the checkpoint recorded" in r.getMessage()]
    assert len(said) == 1 and "trainer's float32 linears on oneDNN" in said[0]
    assert settled("torch", first) == {"trainer": "torch", "engine": "torch"} and asked == []
    assert settled("onednn", {"trainer": "torch"}, engine=False) == {"trainer": "onednn"}
    assert settled("auto", {"trainer": "torch"}) == {"trainer": "torch", "engine": "onednn"}  # timed
    assert settled("auto", {"trainer": "mkl", "engine": "torch"}) == {"trainer": "torch", "engine": "onednn"}
    assert len(asked) == 4
    assert cpu_linear.settle("auto", make_model("tiny", tok).to(torch.bfloat16), first) == {}


def test_fast_engine_says_what_its_cpu_gemms_run_on():
    tok = make_tokenizer()
    m = make_model("tiny", tok)
    assert FastEngine(m, tokenizer=tok, cpu_linear="torch").cpu_linear == "torch"
    assert FastEngine(m, tokenizer=tok, cpu_linear="onednn").cpu_linear == ("onednn" if onednn_available()
                                                                             else "torch")



_RANK = """
import json, sys
import torch, torch.distributed as dist
from nanogrpo.models import cpu_linear
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
timed = []
cpu_linear.onednn_faster = lambda rows, *a: timed.append(rows) or rank == 1  # the ranks' timings disagree
decided = cpu_linear.settle("auto", torch.nn.Sequential(torch.nn.Linear(8, 8)))
print(json.dumps({"decided": decided, "timed": timed}))
from nanogrpo.training.distributed import leave_launched_rank
leave_launched_rank(0)
"""


@pytest.mark.slow
@needs_onednn
def test_ranks_take_rank_0s_decisions():
    """Under torch.distributed rank 0 times and every rank runs on its decisions (one record for all)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert [g["decided"] for g in got] == [{"trainer": "torch", "engine": "torch"}] * 2
    assert got[0]["timed"] == [cpu_linear.TRAIN_ROWS, cpu_linear.DECODE_ROWS] and got[1]["timed"] == []
