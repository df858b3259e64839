"""The sandbox against code written to cheat or to harm the run, as root and as a non-root user.

Each case runs ``tests/sandbox_attacks.py`` (a trainer stand-in with a sibling process of its uid,
the built-in ``python`` tool through ``ToolRunner``; see its docstring for the probes and the
checks after each) with every layer on, with the audit hook off (it is no boundary: code that
reaches C gets around it), and with each kernel layer off in turn besides: Landlock (kernels
before 5.13; signal scoping came in 6.12), the namespaces (no user namespaces for non-root, as
under Ubuntu 23.10+'s AppArmor default), seccomp, and dropping to nobody (root only). Every probe
must end with a status it may end with and break nothing.

This machine runs the tests as root: the non-root cases run the stand-in as uid/gid 4242 (no
account needed). Where the Python installation or the checkout sits under a directory others
cannot enter (``/root`` is 0700), the stand-in runs in a mount namespace of its own where that
directory is a tmpfs holding binds of just those paths; nothing else changes for it.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("sandbox_attacks.py")
REPO = HARNESS.parents[1]
USER = 4242
KERNEL_OFF = {"landlock": ("landlock",), "namespaces": ("netns", "pidns", "mountns"),
              "seccomp": ("seccomp",), "drop": ("drop",)}
CASES = [("all", ()), ("no-audit", ("audit",))] + [(f"no-{k}", ("audit", *v)) for k, v in KERNEL_OFF.items()]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the layers are Linux's")]


def _mount(src, dst, fstype, flags) -> None:
    lc = ctypes.CDLL(None, use_errno=True)
    enc = (lambda s: None if s is None else os.fsencode(s))
    if lc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {dst}: {os.strerror(e)}")


def _closed_ancestor(path: str) -> str | None:
    """The outermost directory on ``path`` that others may not enter."""
    cur = ""
    for part in os.path.realpath(path).split("/")[1:-1]:
        cur += "/" + part
        if not os.stat(cur).st_mode & 0o001:
            return cur
    return None


def _expose(paths: list[str]) -> None:
    """In a new mount namespace, replace each closed directory above ``paths`` by a tmpfs holding
    binds of the entries that lead to them (runs in the child, as root, before it drops to USER)."""
    MS_BIND, MS_REC, MS_PRIVATE = 4096, 0x4000, 1 << 18
    if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    need: dict[str, set[str]] = {}
    for p in paths:
        top = _closed_ancestor(p)
        if top:
            need.setdefault(top, set()).add(os.path.relpath(os.path.realpath(p), top).split("/")[0])
    for top, names in need.items():
        stash = tempfile.mkdtemp(prefix="nanogrpo-expose-")
        _mount(top, stash, None, MS_BIND | MS_REC)
        _mount("tmpfs", top, "tmpfs", 0)
        os.chmod(top, 0o755)
        for name in names:
            src, dst = os.path.join(stash, name), os.path.join(top, name)
            if os.path.isdir(src):
                os.makedirs(dst, exist_ok=True)
            else:
                open(dst, "a").close()
            _mount(src, dst, None, MS_BIND | MS_REC)


def run_stand_in(disable: tuple[str, ...], as_user: bool, *extra: str) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    preexec = None
    if as_user and os.geteuid() == 0:
        paths = [sys.executable, sys.prefix, sys.base_prefix, str(REPO), *[p for p in sys.path if p]]
        paths = [p for p in paths if os.path.exists(p) and _closed_ancestor(p)]

        def preexec():
            if paths:
                _expose(paths)
            os.setgroups([])
            os.setgid(USER)
            os.setuid(USER)
        env["HOME"] = "/tmp"
    proc = subprocess.run([sys.executable, str(HARNESS), ",".join(disable) or "-", *extra],
                          capture_output=True, env=env, preexec_fn=preexec, cwd="/tmp", timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def _check(report: dict, layers_off: tuple[str, ...], as_user: bool, denied_at_least: int = 20) -> None:
    prot = report["protections"]
    if as_user:
        assert report["uid"] != 0
    failures = {k: v for k, v in report["probes"].items()
                if v["broken"] or v["status"] not in v["ok_statuses"]}
    assert not failures, json.dumps({"protections": prot, "failures": failures}, indent=1)[:6000]
    assert report["lingering"] == [], report["lingering"]
    counts, probes = report["counts"], report["probes"].values()
    denied = sum(p["status"] == "denied" for p in probes)
    assert counts.get("denied", 0) == denied >= denied_at_least, counts   # the runner counted what happened
    assert counts.get("timeout", 0) == sum(p["status"] == "timeout" for p in probes)


@pytest.mark.parametrize("name,off", CASES, ids=[c[0] for c in CASES])
def test_as_root(name, off):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    report = run_stand_in(off, as_user=False)
    if "drop" not in off:
        assert report["protections"]["drop_privileges"]
    _check(report, off, as_user=False)


@pytest.mark.parametrize("name,off", [c for c in CASES if c[0] != "no-drop"], ids=[c[0] for c in CASES
                                                                                  if c[0] != "no-drop"])
def test_as_a_user(name, off):
    report = run_stand_in(off, as_user=True)
    prot = report["protections"]
    assert not prot["drop_privileges"]
    if "pidns" not in off and prot["user_namespace"]:     # this machine allows user namespaces
        assert prot["pid_namespace"] and prot["network_namespace"] and prot["private_root"]
    _check(report, off, as_user=True)


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_a_call_holds_nothing_of_another_even_reading_its_own_memory(as_user):
    """With the file layers off (Landlock, the private root) a call reads /proc/self/mem whole: no
    answer and no other call's code anywhere in it, as in its frames, tracebacks and ``gc``."""
    if not as_user and os.geteuid() != 0:
        pytest.skip("needs root")
    report = run_stand_in(("audit", "landlock", "mountns"), as_user, "leaks")
    mem = report["probes"]["memory"]
    assert mem["status"] == "ok" and int(mem["output"].split()[0]) > 10, mem   # it read its mappings
    _check(report, (), as_user, denied_at_least=0)
