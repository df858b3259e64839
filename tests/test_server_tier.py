"""The server tier's pure-Python parts, in the main environment (no vLLM): the pool's load spreading,
failover and taking back, the engine's reading of ``/inference/v1/generate`` answers (version window,
bounded reads), the pipeline's staleness bound and bookkeeping, and the config's checks.

The servers here are small real HTTP servers (``http.server`` in threads) that answer the routes the
client uses the way ``vllm serve`` does (its JSON shapes); tests/test_vllm_server.py runs the same code
against real ``vllm serve`` processes.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nanogrpo.config import Config
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.vllm_server.engine import ServerEngine
from nanogrpo.engines.vllm_server.http import ServerClient, ServerDown, ServerFault, generate_cap
from nanogrpo.engines.vllm_server.pool import BACK, OUT, UP, NoServer, ServerPool
from nanogrpo.errors import ConfigError
from nanogrpo.training.pipeline import Made, Pipeline
from nanogrpo.training.server_tier import staleness


class Fake(BaseHTTPRequestHandler):
    """Answers as vLLM does: ``/health``; ``/inference/v1/generate`` with ``max_tokens`` tokens (ids 7, 8,
    ..., log-prob -0.5 each) under ``server.version``; ``server.huge`` sends a body past the client's cap."""

    def log_message(self, *a):  # quiet
        pass

    def _send(self, code: int, obj) -> None:
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stall(self) -> None:
        """A stalled server (SIGSTOP-like): nothing answers and the connection stays open, until the test
        clears ``stalled``."""
        while self.server.stalled.is_set():
            time.sleep(0.02)

    def do_GET(self):
        self._stall()
        srv = self.server
        if self.path == "/health":
            return self._send(200, {})
        if self.path == "/weight_info":
            return self._send(200, {"weight_version": srv.version})
        if self.path == "/is_paused":
            return self._send(200, {"is_paused": srv.paused})
        self._send(404, {"detail": "no"})

    def do_POST(self):
        srv = self.server
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self._stall()
        if self.path == "/collective_rpc":  # nanogrpo's worker extension, as vLLM relays it
            return self._send(200, {"results": [{"facts": srv.facts, "model": "/models/served"}]})
        srv.hits += 1
        if srv.drop > 0:  # the connection closed with no answer (a keep-alive the server just ended)
            srv.drop -= 1
            self.close_connection = True
            return
        time.sleep(srv.delay)
        n = req["sampling_params"]["max_tokens"]
        if srv.huge:
            return self._send(200, b"[" + b"0," * generate_cap(n) + b"0]")
        ids = [7 + i for i in range(n)]
        choice = {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids,
                  "weight_versions": [{"version": srv.version, "start": 0, "end": n}],
                  "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]}}
        self._send(200, {"choices": [choice]})


def serve(port: int = 0, version: str = "3", delay: float = 0.0):
    srv = ThreadingHTTPServer(("127.0.0.1", port), Fake)
    srv.hits, srv.version, srv.delay, srv.huge = 0, version, delay, False
    srv.stalled = threading.Event()
    srv.drop, srv.paused = 0, False
    srv.facts = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2}
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return srv


def url(srv) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def stop(srv) -> None:
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def two():
    a, b = serve(), serve()
    yield a, b
    for s in (a, b):
        s.stalled.clear()
        try:
            stop(s)
        except OSError:
            pass


def engine_over(*srvs, version: int = 3, **kw) -> ServerEngine:
    pool = ServerPool([ServerClient(url(s), timeout_s=10) for s in srvs], wait_s=kw.pop("wait_s", 2.0),
                      probe_s=0.0)
    for slot in pool.slots:
        pool.mark_synced(slot, str(version))
    eng = ServerEngine(pool, [2], concurrency=8, **kw)
    eng.min_version = eng.max_version = version
    return eng


def test_requests_spread_over_servers_by_load(two):
    a, b = two
    a.delay = 0.2  # a slow server gets fewer requests
    eng = engine_over(a, b)
    g = eng.generate([[1, 2, 3]] * 8, SamplingParams(max_new_tokens=4, n=4, seed=1))
    assert len(g.completion_ids) == 32 and g.completion_ids[0] == [7, 8, 9, 10]
    assert g.logprobs[0] == [-0.5] * 4
    assert a.hits + b.hits == 32 and b.hits > a.hits > 0


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_server_that_stops_answering_is_taken_out_and_its_requests_retried(two):
    a, b = two
    eng = engine_over(a, b)
    stop(a)
    g = eng.generate([[1, 2]] * 4, SamplingParams(max_new_tokens=3, n=2, seed=0))
    assert len(g.completion_ids) == 8 and b.hits == 8
    states = {s.url: s.state for s in eng.pool.slots}
    assert states[url(a)] == OUT and states[url(b)] == UP
    assert eng.pool.retries >= 1 and eng.pool.taken_out == 1


def test_a_server_back_waits_for_weights_before_serving(two):
    a, b = two
    port = a.server_address[1]
    eng = engine_over(a, b)
    stop(a)
    eng.generate([[1]], SamplingParams(max_new_tokens=2, n=4, seed=0))
    assert eng.pool.probe(force=True) == []  # still down
    a2 = serve(port)
    try:
        back = eng.pool.probe(force=True)
        assert [s.url for s in back] == [url(a2)] and back[0].state == BACK
        eng.generate([[1]], SamplingParams(max_new_tokens=2, n=4, seed=0))
        assert a2.hits == 0  # not before its weights are synced
        eng.pool.mark_synced(back[0], "3")
        eng.generate([[1]], SamplingParams(max_new_tokens=2, n=8, seed=0))
        assert a2.hits > 0
    finally:
        stop(a2)


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_sample_outside_the_version_window_takes_its_server_out(two):
    a, b = two
    a.version = "default"  # a restarted server, with its launch weights
    eng = engine_over(a, b)
    g = eng.generate([[1, 2]], SamplingParams(max_new_tokens=2, n=6, seed=0))
    assert len(g.completion_ids) == 6 and {s.url: s.state for s in eng.pool.slots}[url(a)] == OUT
    b.version = "1"  # older than the window [3, 3]: no server left
    eng.pool.wait_s = 0.3
    with pytest.raises(NoServer):
        eng.generate([[1]], SamplingParams(max_new_tokens=2, n=1, seed=0))


def test_versions_are_recorded_per_sample(two):
    a, b = two
    a.version, b.version = "2", "3"
    eng = engine_over(a, b)
    eng.min_version = 2
    with eng.recording() as rec:
        eng.generate([[1]], SamplingParams(max_new_tokens=2, n=6, seed=0))
    assert len(rec) == 6 and set(rec) <= {(2, 2), (3, 3)}
    assert staleness(rec, 3)["staleness/max"] <= 1.0


def test_answers_are_read_with_a_cap(two):
    a, _ = two
    a.huge = True
    with pytest.raises(ServerFault, match="over"):
        ServerClient(url(a)).generate({"token_ids": [1], "sampling_params": {"max_tokens": 2}}, 2)


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_no_server_at_all_is_one_line():
    srv = serve()
    eng = engine_over(srv, wait_s=0.3)
    stop(srv)
    with pytest.raises(NoServer, match="no vLLM server|tries"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2, n=1, seed=0))
    with pytest.raises(ServerDown):
        ServerClient(url(srv), control_timeout_s=1).pause()


def test_the_log_prob_convention_is_checked(two):
    eng = engine_over(*two)  # untempered (raw_logprobs)
    with pytest.raises(ConfigError, match="logprob_temperature"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2, temperature=0.7, logprob_temperature=0.7))


def test_pipeline_keeps_the_staleness_bound():
    started: list[tuple[int, int]] = []
    done = {"step": 0}

    def make(step: int) -> Made:
        started.append((step, done["step"]))
        return Made(step, None, {}, {"at": step})

    pipe = Pipeline(make, 1, 6, k=1)
    try:
        for step in range(1, 7):
            made, _ = pipe.get(step)
            assert made.step == step and made.sampler_state == {"at": step}
            time.sleep(0.05)  # the producer may run ahead now, but not past the bound
            done["step"] = step
            pipe.trained(step)
    finally:
        pipe.close()
    # step s starts only once step s - 2 is trained (k = 1)
    assert all(trained >= s - 2 for s, trained in started) and [s for s, _ in started] == list(range(1, 7))


def test_pipeline_hands_the_producers_error_to_the_trainer():
    def make(step: int) -> Made:
        raise RuntimeError("no server")

    pipe = Pipeline(make, 1, 3, k=2)
    with pytest.raises(RuntimeError, match="no server"):
        pipe.get(1)
    pipe.close()


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=vllm_server"], "needs rollout.servers"),
    (['rollout.servers=["http://a:1"]'], "rollout.engine=vllm_server"),
    (["rollout.max_staleness=1"], "needs rollout.engine=vllm_server"),
    (["rollout.engine=vllm_server", 'rollout.servers=["a:1"]'], "not an http"),
    (["rollout.engine=vllm_server", 'rollout.servers=["http://a:1", "http://a:1"]'], "twice"),
    (["rollout.engine=vllm_server", 'rollout.servers=["http://a:1"]', "rollout.max_staleness=1",
      "train.save_every_updates=1"], "save_every_updates"),
    (["rollout.engine=vllm_server", 'rollout.servers=["http://a:1"]', "train.backend=deepspeed",
      "train.zero_stage=3"], "ZeRO-3"),
    (["rollout.engine=vllm_server", 'rollout.servers=["http://a:1"]', "vllm_server.transfer=rdma"],
     "transfer"),
])
def test_config_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config.load(None, overrides)


def test_config_accepts_the_server_tier():
    cfg = Config.load(None, ["rollout.engine=vllm_server", 'rollout.servers=["http://127.0.0.1:8100"]',
                             "rollout.max_staleness=2", "vllm_server.transfer=nccl"])
    assert cfg.rollout.max_staleness == 2 and cfg.vllm_server.transfer == "nccl"


def test_a_server_gone_before_the_syncs_probe_is_taken_out_not_fatal(two):
    """The probe after a sync asks each server directly (not through the pool's retries): a server that
    died since its sync is taken out (and synced again once back), the others are still probed."""
    from types import SimpleNamespace

    import torch

    from nanogrpo.engines.vllm_server.pool import OUT, UP
    from nanogrpo.training.server_tier import ServerTier

    a, b = two
    eng = engine_over(a, b)
    stop(b)

    class Module(torch.nn.Module):  # uniform over 32 tokens: each log-prob -log(32), the server's -0.5
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, ids):
            return SimpleNamespace(logits=torch.zeros(1, ids.shape[1], 32) + self.w)

    tier = ServerTier.__new__(ServerTier)
    tier.engine, tier.probe_ids = eng, [1, 2, 3]
    tier.backend = SimpleNamespace(rank=0, world_size=1, module=Module())
    diff = tier.probe(new_tokens=4)
    assert [s.state for s in eng.pool.slots] == [UP, OUT] and eng.pool.taken_out == 1
    assert diff == pytest.approx(math.log(32) - 0.5)  # the live server was still probed


_TWO_RANK_PIPELINE = """
import json, sys, time
import torch.distributed as dist
from nanogrpo.training.distributed import Backend, leave_launched_rank
from nanogrpo.training.pipeline import Made, Pipeline, producer_reduce
from nanogrpo.training.server_tier import fresh_everywhere, staleness
import torch
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
be = Backend(torch.nn.Linear(2, 2))
reduce = producer_reduce()
def make(step):  # a producer's batch-wide sums (advantages, refills), as Collector.collect makes them
    sums = []
    for i in range(5):
        sums.append(reduce([float(rank + 1), float(step * 10 + i)]))
        time.sleep(0.002 * (rank + 1))
    return Made(step, None, {}, {"sums": sums}, versions=[(step - 1 - rank, step - 1)] * (rank + 1))
pipe = Pipeline(make, 1, 6, k=2)
out = []
try:
    for step in range(1, 7):
        made, _ = pipe.get(step)
        for _ in range(20):  # the update's collectives, meanwhile, on the trainer thread
            be.all_reduce([1.0, float(rank)], ["sum", "max"])
        now = step - 1
        fresh = fresh_everywhere(min(lo for lo, _ in made.versions) == now, be)
        out.append({"sums": made.sampler_state["sums"], "fresh": fresh,
                    "staleness": staleness(made.versions, now, be.all_reduce)})
        pipe.trained(step)
finally:
    pipe.close()
print(json.dumps(out))
leave_launched_rank(0)
"""


@pytest.mark.slow  # two processes: ~5 s
def test_two_ranks_producers_reduce_beside_the_trainers_collectives():
    """Under torchrun each rank runs a producer: its batch-wide sums go over a gloo group of its own while
    the trainer threads run the update's collectives (no interleaving, no deadlock); the ranks agree on
    freshness and the staleness figures are over both ranks' samples."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANK_PIPELINE, str(r), str(port)], env=env,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert got[0] == got[1]  # every rank ends with the same figures
    for step, row in enumerate(got[0], start=1):
        assert row["sums"] == [[3.0, 2.0 * (step * 10 + i)] for i in range(5)]
        assert row["fresh"] is False  # rank 1's samples are a version behind
        # rank 0: one sample 0 behind; rank 1: two samples 1 behind, spanning two versions
        assert row["staleness"] == {"staleness/min": 0.0, "staleness/mean": pytest.approx(2 / 3),
                                    "staleness/max": 1.0, "staleness/spanning": 2.0}


# ---------------------------------------------------------------------- faults seen in seconds


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_a_stalled_server_is_taken_out_by_the_watch_and_its_requests_go_elsewhere(two):
    a, b = two
    eng = engine_over(a, b, wait_s=10.0)
    eng.pool.watch(every_s=0.1, timeout_s=0.5)
    a.stalled.set()  # every request to it, /health included, hangs (SIGSTOP-like)
    t0 = time.monotonic()
    g = eng.generate([[1, 2]], SamplingParams(max_new_tokens=3, n=8, seed=0))
    took = time.monotonic() - t0
    assert len(g.completion_ids) == 8 and took < 5, took  # not the request timeout (10 s)
    assert [s.state for s in eng.pool.slots] == [OUT, UP] and eng.pool.retries >= 1
    eng.pool.close()


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_closing_the_pool_ends_waiting_and_in_flight_requests_at_once(two):
    a, b = two
    eng = engine_over(a, b, wait_s=60.0)
    a.stalled.set()
    b.stalled.set()
    done: dict = {}

    def run() -> None:
        try:
            eng.generate([[1, 2]], SamplingParams(max_new_tokens=3, n=4, seed=0))
        except Exception as e:  # noqa: BLE001
            done["error"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)  # in flight on the stalled servers, then waiting for a usable one
    t0 = time.monotonic()
    eng.pool.close("the run is stopping")
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - t0 < 3
    assert isinstance(done.get("error"), (NoServer, ServerDown)), done
    a.stalled.clear()
    b.stalled.clear()


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
def test_a_dead_port_at_start_is_one_line_naming_it_in_seconds():
    from nanogrpo.engines.vllm_server.contact import ServerUnreachable, connect
    from nanogrpo.engines.vllm_server.http import ServerRefused

    srv = serve()
    dead = url(srv)
    stop(srv)  # nothing listens there now
    with pytest.raises(ServerRefused):
        ServerClient(dead).pause()
    pool = ServerPool([ServerClient(dead)])
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachable) as err:
        connect(pool, wait_s=1.0)
    msg = str(err.value)
    assert "\n" not in msg and dead in msg and "connection refused" in msg, msg
    assert time.monotonic() - t0 < 4


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
def test_servers_answering_at_start_are_used_the_others_taken_back_later(two):
    from nanogrpo.engines.vllm_server.contact import connect

    a, _ = two
    srv = serve()
    dead = url(srv)
    stop(srv)
    pool = ServerPool([ServerClient(url(a)), ServerClient(dead)])
    assert connect(pool, wait_s=0.5) == [dead]
    assert [s.state for s in pool.slots] == [BACK, OUT]


def test_a_server_with_another_model_is_refused_before_any_weights_move(two):
    from nanogrpo.engines.vllm_server.contact import ServerModelMismatch, connect

    a, b = two
    pool = ServerPool([ServerClient(url(a)), ServerClient(url(b))])
    same = dict(a.facts)
    connect(pool, wait_s=1.0, facts=same)  # the same model: nothing said
    b.facts = {**same, "num_hidden_layers": 3, "vocab_size": 151936}
    with pytest.raises(ServerModelMismatch) as err:
        connect(pool, wait_s=1.0, facts=same)
    msg = str(err.value)
    assert "\n" not in msg and url(b) in msg and "num_hidden_layers 2 here, 3 there" in msg, msg
    assert "vocab_size 96 here, 151936 there" in msg and a.hits == b.hits == 0  # nothing sent


def test_model_facts_of_a_text_and_a_vision_language_config():
    from transformers import AutoConfig

    from nanogrpo.transfer.worker import differences, model_facts

    text = AutoConfig.for_model("qwen2", vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    facts = model_facts(text)
    assert facts["vocab_size"] == 100 and facts["num_hidden_layers"] == 2
    assert facts["num_key_value_heads"] == 2
    assert differences(facts, {**facts, "hidden_size": 64}) == ["hidden_size 32 here, 64 there"]
    assert differences(facts, {"vocab_size": 100}) == []  # what one side does not state is not compared


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
def test_a_fatal_error_ends_the_process_whatever_its_threads_are_doing():
    """The CLI's end (nanogrpo.cli.run): after an error's one line, a thread that would hold the exit for
    minutes (a request waiting out its timeout) does not; the exit code is the error's."""
    import subprocess
    import sys

    code = (
        "import threading, time\n"
        "from nanogrpo import cli\n"
        "from nanogrpo.errors import NanoGRPOError\n"
        "cli.LINGER_S = 1.0\n"
        "threading.Thread(target=time.sleep, args=(600,), name='a request waiting').start()\n"
        "def boom(argv=None):\n"
        "    raise NanoGRPOError('weight sync to version 4: no vLLM server holds the new weights')\n"
        "cli.build_parser = lambda: type('P', (), {'parse_args': lambda self, a: type('A', (), "
        "{'verbose': False, 'command': 'train'})()})()\n"
        "cli.cmd_train = boom\n"
        "raise SystemExit(cli.run())\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, "train"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and time.monotonic() - t0 < 30, (out.returncode, out.stderr)
    assert out.stderr.strip().splitlines()[-1] == ("nanogrpo: error: weight sync to version 4: no vLLM "
                                                   "server holds the new weights")


def test_a_lost_connection_to_a_server_that_answers_is_sent_again_not_a_server_out(two):
    a, b = two
    eng = engine_over(a)
    a.drop = 1  # the first request's connection ends without an answer; /health answers
    g = eng.generate([[1, 2]], SamplingParams(max_new_tokens=3, n=1, seed=0))
    assert len(g.completion_ids) == 1 and eng.pool.slots[0].state == UP
    assert eng.pool.retries == 1 and eng.pool.taken_out == 0


@pytest.mark.slow  # (over 1.3 s: the fast suite stays under a minute)
def test_a_server_out_by_mistake_that_holds_its_weights_is_taken_back_when_none_serves(two):
    a, b = two
    eng = engine_over(a, b, wait_s=10.0)
    for slot in eng.pool.slots:
        eng.pool.mark_out(slot, "a transient fault")  # both out, both still serving version 3
    b.paused = True  # b: a sync of it failed (left paused): it must wait for the next sync
    t0 = time.monotonic()
    g = eng.generate([[1, 2]], SamplingParams(max_new_tokens=3, n=2, seed=0))
    assert len(g.completion_ids) == 2 and time.monotonic() - t0 < 5
    assert [s.state for s in eng.pool.slots] == [UP, OUT]
    a.version = "default"  # a restarted server (its launch weights): never taken back this way
    eng.pool.mark_out(eng.pool.slots[0], "killed and restarted")
    eng.pool.wait_s = 1.0
    with pytest.raises(NoServer):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=3, n=1, seed=0))


def test_vllm_serve_print_gives_lines_that_run_as_printed(tmp_path, capsys):
    """``nanogrpo vllm-serve --print``: the folders the lines name exist (the tokenizer written first),
    paths are absolute, each line splits as a shell splits it, and no placeholder rollout.servers is
    needed for a config without them."""
    import shlex

    from nanogrpo.launch import main

    state = tmp_path / "state"
    assert main(["--print", "--count", "2", "--port", "8100", "--state-dir", str(state),
                 "rollout.engine=vllm_server"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    cmds = [shlex.split(line) for line in lines if not line.startswith(("#", "rollout.servers"))]
    assert len(cmds) == 2
    for port, words in zip((8100, 8101), cmds, strict=True):
        env = [w for w in words if "=" in w and w.split("=")[0].isupper()]
        argv = words[len(env):]
        assert "VLLM_SERVER_DEV_MODE=1" in env and Path(argv[0]).is_file()
        tok = Path(argv[argv.index("--tokenizer") + 1])
        assert tok.is_absolute() and (tok / "tokenizer_config.json").is_file()
        assert Path(argv[argv.index("--model") + 1]).is_dir() and argv[argv.index("--port") + 1] == str(port)
        assert "nanogrpo.transfer.worker.NanoGRPOWorkerExtension" in argv
    assert lines[-1] == 'rollout.servers=\'["http://127.0.0.1:8100", "http://127.0.0.1:8101"]\''


# ------------------------------------------------------------------------ the LoRA adapter sync's metrics


class AdapterServer:
    """A vLLM server as the adapter sync sees it (the client's methods): the RL routes, the adapter routes
    (an adapter loads only when its folder is there, as vLLM reads it from disk) and ``/weight_info``."""

    def __init__(self, url: str):
        self.url, self.version, self.paused = url, "default", False
        self.adapters: set[str] = set()
        self.received = 0
        """Bytes the trainer's transfer engine sent it (the base weights)."""

    def health(self, timeout=None):
        return None

    def healthy(self, timeout=None):
        return True

    def is_paused(self):
        return self.paused

    def pause(self, mode="keep"):
        self.paused = True

    def resume(self):
        self.paused = False

    def finish_weight_update(self):
        pass

    def update_weight_version(self, v):
        self.version = v

    def weight_version(self):
        return self.version

    def models(self):
        return ["policy", *sorted(self.adapters)]

    def load_adapter(self, name, path):
        if not (Path(path) / "adapter_model.safetensors").is_file():
            raise ServerFault(f"no adapter at {path}")
        self.adapters.add(name)

    def unload_adapter(self, name):
        self.adapters.discard(name)

    def abort(self):
        pass


class BaseState:
    """A PEFT policy's frozen base weights as the weight sync's source (what
    :func:`~nanogrpo.engines.vllm_server.base_source` gives, without vLLM's ``WeightSource`` class)."""

    def __init__(self, model):
        from nanogrpo.models.lora import base_state_dict

        self.state = base_state_dict(model)

    def __iter__(self):
        return iter(self.state.items())

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


class SentEngine:
    """The trainer-side transfer engine of one server: every tensor of the source, counted."""

    def __init__(self, server: AdapterServer, source):
        self.server, self.source = server, source

    def send_weights(self):
        time.sleep(0.01)
        for _, t in self.source:
            self.server.received += t.numel() * t.element_size()

    def shutdown(self):
        pass


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_the_adapter_syncs_metrics_count_every_byte_sent_on_a_rejoin(tmp_path, monkeypatch):
    """``sync/mb`` is every byte sent: the adapter to each server, and the base weights sent whole to a
    server that rejoins (``sync/base_servers``, ``sync/base_mb``); ``sync/mb_per_s`` is logged as on the
    full path. The real AdapterSync, WeightSync and ServerPool; the servers' routes and the transfer engine
    faked."""
    pytest.importorskip("peft")
    from nanogrpo.config import ModelConfig
    from nanogrpo.engines.vllm_server.adapters import AdapterSync
    from nanogrpo.engines.vllm_server.sync import WeightSync
    from nanogrpo.models.lora import apply_lora
    from nanogrpo.models.tiny import make_model, make_tokenizer

    model = apply_lora(make_model("tiny", make_tokenizer()), ModelConfig(lora_r=4, lora_alpha=8.0))
    servers = [AdapterServer("http://a"), AdapterServer("http://b")]
    pool = ServerPool(servers, wait_s=1.0, probe_s=0.0)
    source = BaseState(model)
    base = WeightSync(pool, source)
    monkeypatch.setattr(WeightSync, "_build", lambda self, slot: SentEngine(slot.client, self.source))
    sync = AdapterSync(base, model, tmp_path / "adapters")
    base_mb = source.total_bytes() / 2**20
    assert base_mb > 0

    def check(out: dict, n_base: int) -> None:
        assert out["sync/servers"] == 2 and out["sync/base_servers"] == n_base, out
        assert out["sync/mb"] == pytest.approx(2 * out["sync/adapter_mb"] + base_mb * n_base), out
        assert out["sync/base_mb"] == pytest.approx(base_mb * n_base)
        assert out["sync/mb_per_s"] == pytest.approx(out["sync/mb"] / out["sync/send_s"])
        assert 0 < out["sync/send_s"] <= out["sync/time_s"]

    out = sync.sync(1)  # both new: the base whole to each, then the adapter
    adapter_mb = out["sync/adapter_mb"]
    assert 0 < adapter_mb < base_mb / 5
    check(out, 2)
    assert sum(s.received for s in servers) / 2**20 == pytest.approx(base_mb * 2)
    for s in servers:
        s.received = 0
    assert sync.sync(2)["sync/base_mb"] == 0.0 and sum(s.received for s in servers) == 0
    check(sync.last, 0)
    pool.mark_out(pool.slots[1], "killed")  # b restarts between versions: its launch weights, no adapter
    servers[1].version, servers[1].adapters = "default", set()
    out = sync.sync(3)  # b rejoins: the base whole, then the adapter; a the adapter only
    check(out, 1)
    assert servers[1].received / 2**20 == pytest.approx(out["sync/base_mb"])
    assert [s.state for s in pool.slots] == [UP, UP] and all("policy-v3" in s.adapters for s in servers)


# ------------------------------------------------------------------------ the servers' tokenizer folder


def _as_vllm_loads(folder: Path):
    """The tokenizer as vLLM loads a ``--tokenizer`` folder: its config.json parsed (vLLM logs an ERROR, twice
    per process, when that fails), then ``AutoTokenizer`` given that config."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)  # raises where vLLM's parser logs "Error parsing config"
    return AutoTokenizer.from_pretrained(folder, config=config)


def test_the_servers_tokenizer_folder_parses_as_vllm_parses_it_and_stays_the_tokenizer(tmp_path):
    """``nanogrpo vllm-serve``'s tokenizer folder has a config.json vLLM's config parser reads (no
    ``Error parsing config for <folder>: Unrecognized model`` at each server start), and the tokenizer vLLM
    then loads is nanogrpo's: the demo's char-level one stays char-level (the model's Qwen2 config would make
    it Qwen2's), a model's own family tokenizer keeps the model's config."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from nanogrpo.launch import serve_command
    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.models.tiny import make_model, make_tokenizer

    probe = "<think>12 + 3 = 15</think>\n<answer>15</answer> Hello, World! x^2 - 3y = 7; ünï 数学"

    cfg = Config.load(None, ["rollout.engine=vllm_server", 'rollout.servers=["http://127.0.0.1:1"]',
                             "model.lora_r=8"])
    cmd, _ = serve_command(cfg, 8100, state_dir=tmp_path / "state", cuda=False)
    folder = Path(cmd[cmd.index("--tokenizer") + 1])
    demo = load_tokenizer(cmd[cmd.index("--model") + 1])
    got = _as_vllm_loads(folder)
    assert got(probe).input_ids == demo(probe).input_ids
    assert got.get_vocab() == demo.get_vocab()
    assert load_tokenizer(str(folder))(probe).input_ids == demo(probe).input_ids

    # a byte-level BPE of the model's own family (Qwen2Tokenizer): the model's config.json beside it
    chars = sorted(set(bytes_to_unicode().values()))
    vocab = {c: i for i, c in enumerate(chars)} | {"Ġt": len(chars), "he": len(chars) + 1}
    own = Qwen2Tokenizer(vocab=vocab, merges=[("Ġ", "t"), ("h", "e")], eos_token="<|endoftext|>",
                         unk_token=None)
    model_dir = tmp_path / "model"
    m = make_model("tiny", make_tokenizer())
    m.config.vocab_size = len(own)
    m.config.save_pretrained(model_dir)
    own.save_pretrained(model_dir)
    own = load_tokenizer(str(model_dir))
    from nanogrpo.launch import save_tokenizer

    save_tokenizer(own, str(model_dir), tmp_path / "own")
    assert json.loads((tmp_path / "own" / "config.json").read_text())["model_type"] == "qwen2"
    got = _as_vllm_loads(tmp_path / "own")
    assert type(got).__name__ == type(own).__name__
    assert got(probe).input_ids == own(probe).input_ids
