"""The tool sandbox under attack: each limit holds, the model gets an error text, the run goes on.

Every attack runs with all protection layers and, where it says something, with one layer alone
(the others disabled), so each layer is shown to hold by itself where the kernel offers it."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest

from nanogrpo.errors import ToolError
from nanogrpo.tools.sandbox import LAYERS, Sandbox

PY = "nanogrpo.tools.python:run_python"
ALL_LAYERS = LAYERS
REFUSED = ("error", "denied")  # denied: a PermissionError (the sandbox refused); error: any other
PRELOAD = ["math", "socket"]  # import socket in the server: the network layers are then what stops it


def only(layer: str) -> tuple[str, ...]:
    return tuple(x for x in ALL_LAYERS if x != layer)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(PY, timeout_s=1.5, memory_mb=256, output_bytes=4096, workers=4, preload=PRELOAD) as sb:
        yield sb


def _alive(sb: Sandbox) -> None:
    [res] = sb.run([("print(6 * 7)", {})])
    assert (res.status, res.output) == ("ok", "42\n")


def test_protections_in_force_here(sandbox):
    p = sandbox.protections
    if os.geteuid() == 0:
        assert p["drop_privileges"]
    assert p["rlimits"] and p["audit_hook"]
    print("sandbox protections:", p)


@pytest.mark.slow
def test_attacks_in_one_batch_and_the_run_goes_on(sandbox, tmp_path):
    secret = tmp_path / "trainer_state.txt"
    secret.write_text("trainer secret")
    secret.chmod(0o644)
    os.environ["NANOGRPO_TEST_SECRET"] = "hunter2"
    try:
        calls = {
            "loop": "while True: pass",
            "memory": "x = bytearray(4 << 30)\nprint(len(x))",
            "fork": "import os\nwhile True:\n    os.fork()",
            "env": "import os\nprint(sorted(os.environ))\nprint(os.environ.get('NANOGRPO_TEST_SECRET'))",
            "proc_env": f"print(open('/proc/{os.getpid()}/environ', 'rb').read()[:50])",
            "file": f"print(open({str(secret)!r}).read())",
            "flood": "print('x' * (10 << 20))",
            "flood_loop": "while True:\n    try:\n        print('y' * 1000)\n"
                          "    except Exception:\n        pass",
            "raise": "def f(x):\n    return 1 / x\nf(0)",
            "exit": "import os\nos._exit(3)",
            "ok": "sum(range(10))",
        }
        t0 = time.monotonic()
        res = dict(zip(calls, sandbox.run([(c, {"question": "q"}) for c in calls.values()]), strict=True))
        took = time.monotonic() - t0
    finally:
        del os.environ["NANOGRPO_TEST_SECRET"]
    assert took < 15, took
    assert res["loop"].status == "timeout"
    assert res["memory"].status == "error" and "MemoryError" in res["memory"].output
    assert res["fork"].status in REFUSED and "fork" in res["fork"].output
    assert res["env"].status == "ok" and "hunter2" not in res["env"].output
    names = "['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH', 'TMPDIR']"
    assert names in res["env"].output
    assert res["proc_env"].status == "denied" and "hunter2" not in res["proc_env"].output
    assert res["file"].status == "denied" and "trainer secret" not in res["file"].output
    assert res["flood"].status == "overflow" and len(res["flood"].output.encode()) <= 4096
    assert res["flood_loop"].status in ("overflow", "timeout")
    assert len(res["flood_loop"].output.encode()) <= 4096
    assert res["raise"].status == "error" and "ZeroDivisionError" in res["raise"].output
    assert 'File "<tool>", line 2, in f' in res["raise"].output and "_zygote" not in res["raise"].output \
        and "_call.py" not in res["raise"].output
    assert res["exit"].status == "crash" and "code 3" in res["exit"].output
    assert (res["ok"].status, res["ok"].output) == ("ok", "45\n")
    _alive(sandbox)


@pytest.mark.parametrize("layers", ["all", *[pytest.param(x, marks=pytest.mark.slow)
                                             for x in ("netns", "landlock", "seccomp", "audit")]])
@pytest.mark.slow
def test_no_network(layers, tmp_path):
    """A TCP connect and a UDP datagram to listeners of this (the trainer's) process never arrive."""
    disable = () if layers == "all" else only(layers)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.settimeout(0.5)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    code_tcp = f"import socket\nsocket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=1)"
    code_udp = "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hi', " \
               f"('127.0.0.1', {udp.getsockname()[1]}))\nprint('sent')"
    with Sandbox(PY, timeout_s=3, workers=2, preload=PRELOAD, disable=disable) as sb:
        if layers == "netns" and not sb.protections["network_namespace"]:
            pytest.skip("no network namespace here")
        if layers == "landlock" and (sb.protections["landlock"] or 0) < 4:
            pytest.skip("no Landlock network rules here")
        r_tcp, r_udp = sb.run([(code_tcp, {}), (code_udp, {})])
        assert r_tcp.status in REFUSED, r_tcp
        with pytest.raises(socket.timeout):
            tcp.accept()
        if layers != "landlock":  # Landlock filters TCP only; UDP needs the namespace or the hook
            assert r_udp.status in REFUSED, r_udp
            with pytest.raises(socket.timeout):
                udp.recvfrom(10)
        _alive(sb)
    tcp.close()
    udp.close()


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["landlock", "mountns", "audit", "drop"])
def test_each_layer_keeps_trainer_files_and_processes_out(layers, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("trainer secret")
    secret.chmod(0o600)
    with Sandbox(PY, timeout_s=3, workers=2, preload=PRELOAD, disable=only(layers)) as sb:
        if layers == "landlock" and not sb.protections["landlock"]:
            pytest.skip("no Landlock here")
        if layers == "mountns" and not sb.protections["private_root"]:
            pytest.skip("no private root here")
        if layers == "drop" and not sb.protections["drop_privileges"]:
            pytest.skip("not root: nothing to drop")
        read, = sb.run([(f"print(open({str(secret)!r}).read())", {})])
        assert read.status in REFUSED and "trainer secret" not in read.output
        if layers in ("audit", "drop"):  # the hook refuses it; RLIMIT_NPROC = 0 once not root (never run
            # where neither holds: Landlock alone, as root, would let a fork bomb loose for timeout_s)
            fork, = sb.run([("import os\nfor _ in range(50):\n    os.fork()\nprint('forked')", {})])
            assert fork.status in REFUSED and "forked" not in fork.output
        _alive(sb)


@pytest.mark.slow
def test_user_tool_by_name_runs_sandboxed():
    with Sandbox("tests.tool_fixtures:echo_question", timeout_s=1, workers=1) as sb:
        ok, = sb.run([("hello", {"question": "Q?"})])
        assert (ok.status, ok.output) == ("ok", "hello | Q?")
    with Sandbox("tests.tool_fixtures:hang", timeout_s=0.5, workers=1) as sb:
        t0 = time.monotonic()
        hung, = sb.run([("x", {})])
        assert hung.status == "timeout" and time.monotonic() - t0 < 5


@pytest.mark.slow
def test_a_dead_server_is_restarted(sandbox):
    sandbox._proc.kill()
    sandbox._proc.wait()
    _alive(sandbox)                                    # found dead before the call: started again
    proc = sandbox._proc
    killer = threading.Timer(0.3, proc.kill)           # killed during a call
    killer.start()
    res = sandbox.run([("import time\ntime.sleep(2)\nprint('done')", {})])
    killer.join()
    assert res[0].status == "crash" and sandbox.restarts >= 1   # that call is lost, the run is not
    _alive(sandbox)


def test_bad_tool_and_isolation_demand_fail_at_start():
    with pytest.raises(ToolError, match="cannot load tool"):
        Sandbox("tests.tool_fixtures:no_such_function").start()
    with pytest.raises(ToolError, match="require_isolation"):
        Sandbox(PY, require_isolation=True, disable=("netns", "landlock")).start()
    with pytest.raises(ToolError, match="pid_namespace"):
        Sandbox(PY, require_isolation=True, disable=("pidns",)).start()
    with pytest.raises(ToolError, match="unknown sandbox layer"):
        Sandbox(PY, disable=("selinux",))


def test_protections_reported(sandbox):
    p = sandbox.protections
    for key in ("network_namespace", "pid_namespace", "private_root", "landlock", "seccomp"):
        assert key in p
    if sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64"):
        assert p["seccomp"]                    # works unprivileged on every Linux since 3.5


def test_the_python_tool_gets_no_sample_and_a_custom_tool_only_its_fields():
    from nanogrpo.config import ToolsConfig
    from nanogrpo.errors import ConfigError
    from nanogrpo.tools.protocols import Call
    from nanogrpo.tools.runner import ToolRunner

    row = {"question": "Q?", "answer": "42", "id": 7}
    with pytest.raises((ConfigError, ValueError), match="sample_fields"):
        ToolsConfig(enabled=True, sample_fields=["answer"])
    with ToolRunner(ToolsConfig(enabled=True, timeout_s=2, workers=1, preload=[])) as tools:
        [res] = tools.run([Call("import sys\nprint(sorted(sys._getframe(1).f_locals['sample']))")], [row])
        assert (res.status, res.output) == ("ok", "[]")
    cfg = ToolsConfig(enabled=True, function="tests.tool_fixtures:show_sample", sample_fields=["question"],
                      timeout_s=2, workers=1, preload=[])
    with ToolRunner(cfg) as tools:
        [res] = tools.run([Call("x")], [row])
        assert (res.status, res.output) == ("ok", "{'question': 'Q?'}")
        with pytest.raises(ToolError, match="sample_fields names \\['question'\\]"):
            tools.run([Call("x")], [{"prompt": "no question here"}])


def test_seccomp_program_covers_both_architectures():
    from nanogrpo.tools import _seccomp as sc

    for machine in ((0, 0xC000003E), (1, 0xC00000B7)):
        rows = sc.program(1234, machine)
        assert rows[0] == (sc.LD_ABS, 0, 0, sc.OFF_ARCH) and rows[1][3] == machine[1]
        assert rows[2] == (sc.RET, 0, 0, sc.RET_KILL_PROCESS)          # another architecture: killed
        assert ((sc.JGE, 0, 1, sc.X32_BIT) in rows) == (machine[0] == 0)  # x32 numbers on x86_64
        denied = {r[3] for r in rows if r[0] == sc.JEQ and r[1:3] == (0, 1)}
        for name in sc.DENY:
            nr = sc.NR[name][machine[0]]
            assert nr is None or nr in denied, name
        assert rows[-1] == (sc.RET, 0, 0, sc.RET_ALLOW)
        assert 1234 in {r[3] for r in rows} and (-1234 & 0xFFFFFFFF) in {r[3] for r in rows}


def test_tool_metrics_count_denied_calls():
    from nanogrpo.rollout.turns import _Trajectory, tool_metrics

    trajs = [_Trajectory(calls=2, errors=2, denied=1), _Trajectory(calls=1, timeouts=1)]
    m = tool_metrics(trajs, 0.5)
    assert (m["tools/calls"], m["tools/errors"], m["tools/denied"], m["tools/timeouts"]) == (3, 2, 1, 1)


def test_the_start_up_line_names_the_layers_off():
    from nanogrpo.tools.sandbox import describe

    every = {"network_namespace": True, "pid_namespace": True, "private_root": True, "seccomp": True,
             "landlock": 7, "drop_privileges": True, "audit_hook": True, "rlimits": True}
    text, missing = describe(every)
    assert not missing and "OFF" not in text and "Landlock ABI 7" in text
    text, missing = describe({**every, "pid_namespace": False, "landlock": 4, "private_root": False,
                              "private_root_error": "mount /x: EPERM"})
    assert missing and text.endswith("OFF: PID namespace, private root (mount /x: EPERM)")
    assert "Landlock ABI 4 (signals not scoped)" in text
