"""LoRA on the server tier, adapter-only sync (``vllm_server.lora_sync=adapter``), against two real ``vllm
serve`` processes started by ``nanogrpo vllm-serve`` for a LoRA run (LoRA on at the run's rank, runtime
adapter loading): the servers hold the frozen base weights, each sync writes the adapter and every server
loads it by name.

- after every sync, both servers' log-probs of a probe (the newest adapter on the base) equal the
  trainer's PEFT model's, and the bytes moved are the adapter's, not the model's;
- a server killed between adapter versions comes back (restarted by the launcher) with the base weights
  and the current adapter before it serves, and one that cannot load an adapter is taken out;
- ``nanogrpo train`` with ``model.lora_r`` on the servers, both sync paths (adapter, merged): every step's
  probe equal, the adapter path moving a fraction of the bytes;
- a server started without LoRA is refused in one line before any weights move.

Needs vLLM (skipped without it unless ``NANOGRPO_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

if os.environ.get("NANOGRPO_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI built the vLLM environment: its absence is a failure)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("peft")

from tests.vllm_fixtures import ROOT, RUN, Servers, child_env, demo_model, rows, train  # noqa: E402

pytestmark = pytest.mark.slow
R = 8
LORA = ["model.lora_r=8", "model.lora_alpha=16"]
PROMPT = [1, 5, 6, 7]


class LoraServers(Servers):
    """Two servers launched for a LoRA run (the launcher reads ``model.lora_r``)."""

    def overrides(self) -> list[str]:
        return super().overrides() + LORA


@pytest.fixture(scope="module")
def lora_servers(tmp_path_factory):
    s = LoraServers(tmp_path_factory.mktemp("vllm-lora-servers"))
    try:
        s.launch()
        print(f"vllm serve x2 (LoRA) up in {max(s.wait(0), s.wait(1)):.0f} s")
        yield s
    finally:
        s.stop()


def _policy(seed: int = 0):
    from nanogrpo.config import ModelConfig
    from nanogrpo.models.lora import apply_lora

    model = apply_lora(demo_model(), ModelConfig(lora_r=R, lora_alpha=16.0))
    _nudge(model, seed)
    return model.eval()


def _nudge(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)  # an update of the adapter only


def _tier(servers, model, adapter_dir, keep: int = 2):
    from nanogrpo.engines.vllm_server import base_source
    from nanogrpo.engines.vllm_server.adapters import AdapterSync
    from nanogrpo.engines.vllm_server.engine import ServerEngine
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import ServerPool
    from nanogrpo.engines.vllm_server.sync import WeightSync

    pool = ServerPool([ServerClient(u) for u in servers.urls], wait_s=30.0)
    base = WeightSync(pool, base_source(model, torch.float32), timeout_s=60)
    return ServerEngine(pool, [2], adapters=True), AdapterSync(base, model, adapter_dir, keep=keep)


def _probe(engine, model) -> dict[str, float]:
    from nanogrpo.engines.base import SamplingParams

    out = {}
    for slot in engine.pool.usable():
        ids, lps = engine.sample_on_server(slot, PROMPT, SamplingParams(max_new_tokens=8, temperature=1.0,
                                                                        seed=5))
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1].float()
        mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        out[slot.url] = float((mine - torch.tensor(lps)).abs().max())
    return out


def test_a_lora_servers_start_logs_no_error(lora_servers):
    """First in the module: the two servers' logs of their start (launcher-written tokenizer folder, LoRA
    on) hold no ERROR line; vLLM's probe of a tokenizer folder without a config.json logged two
    ``Error parsing config for <state>/tokenizer: Unrecognized model`` per process, four per server."""
    for i in range(2):
        text = lora_servers.log(i).read_text()
        assert "Error parsing config" not in text, text[-3000:]
        errors = [line for line in text.splitlines() if " ERROR " in line]
        assert not errors, errors


def test_every_adapter_sync_gives_both_servers_the_trainers_policy(lora_servers, tmp_path):
    from nanogrpo.engines.base import SamplingParams
    from nanogrpo.engines.vllm_inprocess import policy_state_dict
    from nanogrpo.engines.vllm_server.adapters import adapter_name

    model = _policy(1)
    engine, sync = _tier(lora_servers, model, tmp_path / "adapters")
    merged_mb = sum(v.numel() * v.element_size() for v in policy_state_dict(model).values()) / 2**20
    try:
        for version in range(1, 5):
            out = sync.sync(version)
            assert out["sync/servers"] == 2, out
            assert out["sync/base_servers"] == (2 if version == 1 else 0)  # the base once, then adapters
            assert out["sync/adapter_mb"] < merged_mb / 5, (out, merged_mb)
            engine.min_version = sync.floor(1)
            engine.max_version = version
            diffs = _probe(engine, model)
            assert len(diffs) == 2 and max(diffs.values()) < 1e-4, (version, diffs)
            with engine.recording() as rec:
                engine.generate([[1, 5, 6]], SamplingParams(max_new_tokens=6, n=6, seed=version))
            assert set(rec) == {(version, version)}  # every sample under the adapter it named
            for c in (s.client for s in engine.pool.slots):  # the window's adapters held, older unloaded
                held = {n for n in c.models() if n.startswith("policy-v")}
                assert held == {adapter_name(v) for v in range(max(1, version - 1), version + 1)}, held
            _nudge(model, 10 + version)
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["policy-v3", "policy-v4"]
        # a request for an adapter the servers dropped is refused by them (404): never sampled under it
        from nanogrpo.engines.vllm_server.engine import StaleSample

        engine.max_version = 1
        body = engine._body(PROMPT, SamplingParams(max_new_tokens=2, seed=0), 0, None)
        with pytest.raises(StaleSample, match="does not serve policy-v1"):
            engine._ask(engine.pool.slots[0].client, body, 2)
    finally:
        engine.pool.close()
        sync.close()


def test_a_server_killed_between_adapter_versions_comes_back_with_the_current_one(lora_servers, tmp_path):
    from nanogrpo.engines.vllm_server.pool import OUT, UP

    model = _policy(2)
    engine, sync = _tier(lora_servers, model, tmp_path / "adapters")
    try:
        sync.sync(1)
        lora_servers.kill(1)  # between versions 1 and 2
        _nudge(model, 20)
        out = sync.sync(2)
        assert out["sync/servers"] == 1 and [s.state for s in engine.pool.slots] == [UP, OUT]
        engine.min_version = engine.max_version = 2
        assert max(_probe(engine, model).values()) < 1e-4
        lora_servers.restart(1)  # the launcher restarts it: launch weights, no adapter
        _nudge(model, 21)
        out = sync.sync(3)  # synced whole (the base), then the current adapter, then it serves
        assert out["sync/servers"] == 2 and out["sync/base_servers"] == 1, out
        base_mb = sync.base.source.total_bytes() / 2**20  # every byte sent: the base to it, both adapters
        assert out["sync/base_mb"] == pytest.approx(base_mb) and base_mb > 10 * out["sync/adapter_mb"], out
        assert out["sync/mb"] == pytest.approx(base_mb + 2 * out["sync/adapter_mb"]), out
        assert out["sync/mb_per_s"] == pytest.approx(out["sync/mb"] / out["sync/send_s"]), out
        engine.min_version = engine.max_version = 3
        diffs = _probe(engine, model)
        assert len(diffs) == 2 and max(diffs.values()) < 1e-4, diffs
    finally:
        engine.pool.close()
        sync.close()


def test_a_server_that_cannot_read_the_adapter_is_taken_out(lora_servers, tmp_path):
    from nanogrpo.engines.vllm_server.pool import OUT, UP

    model = _policy(3)
    engine, sync = _tier(lora_servers, model, tmp_path / "adapters")
    try:
        sync.sync(1)
        real = engine.pool.slots[1].client.load_adapter

        def elsewhere(name: str, path: str) -> None:  # as a server on a machine without that directory
            real(name, str(tmp_path / "not-shared" / name))

        engine.pool.slots[1].client.load_adapter = elsewhere
        _nudge(model, 30)
        out = sync.sync(2)
        assert out["sync/servers"] == 1 and [s.state for s in engine.pool.slots] == [UP, OUT]
        engine.pool.slots[1].client.load_adapter = real
        _nudge(model, 31)
        sync.sync(3)  # it answers: synced whole, the adapter loaded, serving again
        engine.min_version = engine.max_version = 3
        assert [s.state for s in engine.pool.slots] == [UP, UP]
        assert max(_probe(engine, model).values()) < 1e-4
    finally:
        engine.pool.close()
        sync.close()


@pytest.mark.parametrize("how", ["adapter", "merged"])
def test_a_lora_run_on_the_servers_both_sync_paths(lora_servers, tmp_path, how):
    out = tmp_path / "run"
    train(lora_servers, out, "train.steps=3", f"vllm_server.lora_sync={how}", *LORA)
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        assert r["sync/servers"] == 2 and r["sync/probe_diff"] < 1e-4, r
        assert abs(r["is_weight_max"] - 1) < 1e-3
    mb = [r["sync/mb"] / r["sync/servers"] for r in got]
    if how == "adapter":
        assert all(m < 1.0 for m in mb) and all("sync/adapter_mb" in r for r in got), mb  # adapter ~0.2 MB
    else:
        assert all(m > 2.0 for m in mb), mb  # the demo model merged, 3.1 MB


def test_servers_without_lora_are_refused_in_one_line_before_any_weights_move(servers, tmp_path):
    """The session's plain servers (tests/vllm_fixtures.py) for a LoRA run that serves its adapter."""
    import subprocess

    t0 = time.monotonic()
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "nanogrpo.cli", "train", "--out", str(tmp_path / "run"),
                             *servers.overrides(), *RUN, "train.steps=2", *LORA], cwd=ROOT, env=child_env(),
                            stdout=f, stderr=subprocess.STDOUT, timeout=300).returncode
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("nanogrpo: error:")]
    assert rc == 2 and len(errors) == 1, text[-3000:]
    assert "LoRA off" in errors[0] and "lora_sync=merged" in errors[0], errors[0]
    assert time.monotonic() - t0 < 300
