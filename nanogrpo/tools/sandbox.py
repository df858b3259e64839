"""A sandbox for tool calls written by the model: every call in a fresh, locked-down process.

The code a policy writes is adversarial by construction: whatever raises the reward gets
reinforced, reading the reference answer or slowing the run down included. :class:`Sandbox`
starts one *fork server* (``python -I nanogrpo/tools/_zygote.py``, standard library only) with an
environment of five fixed variables (none of the trainer's), in its own session and private
directory. The server imports the tool function (and ``preload`` modules) once; for each call
the trainer writes the call (and the sample fields the tool may see) into a memfd and hands it,
with the write end of a result pipe, to the server, which forks the call's process at once and
gives it the two descriptors (at most ``workers`` calls at a time). The call's process locks
itself down, runs ``tool(call, sample)``, writes back what it printed and returned (up to
``output_bytes``) and exits. A tool that raises, is refused, hangs, crashes, floods its output
or breaks a limit gives the model an error text and a status (``error``, ``denied``,
``timeout``, ``crash``, ``overflow``) that the caller counts; the server and the run carry on.
A server that dies or stops answering is killed and restarted; its calls get ``crash``.

What is guaranteed (Linux), whatever the code does:

- **a call holds nothing but its own call**: its code and sample never pass through the server
  (a call's process is a copy of the server's memory), so no call can find another call's code,
  sample or output in its frames, its tracebacks, ``gc`` or its raw memory; the built-in
  ``python`` tool receives no sample at all, a custom tool the ``tools.sample_fields`` it
  declares (:class:`~nanogrpo.tools.runner.ToolRunner`), and the harness's frames hold only
  those, the limits and paths;
- **a fresh process per call**, forked from the server (never from the trainer), killed
  (SIGKILL) at ``timeout_s`` of wall-clock time; ``RLIMIT_CPU`` stops it after about as much
  CPU time; not dumpable (no process of its uid may trace it or read its memory or ``/proc``);
- **limits** (rlimits, set before the code runs): address space ``memory_mb``, file size
  ``file_mb``, 64 open files, no core dumps, and ``RLIMIT_NPROC = 0``: no new process or
  thread (a fork bomb stops at the first fork). Linux exempts root from ``RLIMIT_NPROC``, hence:
- **privileges dropped**: when the trainer runs as root, each call's process switches to
  uid/gid 65534 (``nobody``) with no supplementary groups, after ``PR_SET_NO_NEW_PRIVS``; and it
  gives up every capability (those a user namespace grants its creator included);
- **no environment**: ``os.environ`` holds only ``PATH``, ``LANG``, ``OMP_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` (and ``HOME``/``TMPDIR``: its directory);
  ``python -I`` ignores ``PYTHON*`` variables and the user site directory; no descriptor but
  its result pipe; stdin, stdout and stderr are ``/dev/null``;
- **a throwaway working directory**, removed after the call;
- **the output is capped**: past ``output_bytes`` the tool is stopped and the model gets the first
  ``output_bytes`` and a note; the trainer also kills a call that writes more than it should.

Where the kernel allows it (reported by :attr:`Sandbox.protections` and the run's start-up line;
``require_isolation`` refuses to start without any of :data:`ISOLATION`); each is off where the
kernel refuses it, and each can be turned off (``disable``, tests only):

- ``network_namespace``: the server moves into a new network namespace (as non-root inside a
  user namespace that maps only its own uid) before forking anything: no interface but a
  loopback that is down, no abstract unix socket of the host;
- ``pid_namespace``: each call is pid 1 of a PID namespace of its own: it sees, signals,
  renices, pins, traces no other process (``setpriority(PRIO_USER)`` reaches only itself);
- ``private_root`` (a mount namespace): the server pivots into an empty read-only tmpfs holding
  read-only binds of the Python installation and the system libraries, and each call gets a
  tmpfs of ``4 * file_mb + 4`` MB as its directory: no trainer file, no ``/proc``, ``/sys``,
  ``/tmp``, ``/dev/shm``, home or host socket exists for it, and no call fills another's disk;
- ``landlock`` (Linux >= 5.13, its ABI version): read-only access to the same directories,
  read-write to its own, nothing else; ABI >= 4 also denies TCP bind/connect, ABI >= 6 signals
  and abstract unix sockets to processes outside its domain;
- ``seccomp`` (:mod:`nanogrpo.tools._seccomp`, our own short BPF filter, x86_64 and aarch64):
  no signal, ``pidfd``, ``prlimit`` but to itself; no ``ptrace``, ``process_vm_readv``/
  ``writev``, ``setpriority``, ``sched_setaffinity``/``setscheduler``, ``ioprio_set``,
  ``perf_event_open``, ``bpf``, ``userfaultfd``, keyrings, ``io_uring``, mounts, ``unshare``/
  ``setns``, ``execve``, ``socket``; another architecture's calls kill it. It carries the
  process rules alone where the namespaces are missing (no user namespaces for non-root: the
  default on Ubuntu 23.10+) and Landlock cannot scope signals (before 6.12: Ubuntu 22.04 and
  24.04, RHEL 9).

Defence in depth, never a boundary: an audit hook (PEP 578) in the child refuses sockets, new
processes, signals, ``ctypes`` calls and file access outside those directories; frames,
``gc`` and C code get around it.

Not guaranteed: isolation from kernel exploits or side channels; CPU or memory shares between
concurrent calls beyond their own rlimits. Without both Landlock and the private root, files
are kept out only by dropping to ``nobody`` (root) and the audit hook; without both the
namespaces and seccomp, other processes of the uid are reachable. Modules that are not
preloaded are imported by the call itself from the read-only directories (as ``nobody``
without the private root, only world-readable installations: list what the tool's code imports
in ``preload``). Needs Linux.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogrpo.errors import ToolError

log = logging.getLogger("nanogrpo.tools")

ZYGOTE = Path(__file__).with_name("_zygote.py")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
STATUSES = ("ok", "error", "denied", "timeout", "crash", "overflow", "invalid")
"""``denied``: the code ended on what only the sandbox causes (a ``PermissionError``, a process out
of reach, the read-only root, a forbidden system call); ``invalid`` is the caller's: a malformed
call that never reached the sandbox."""
LAYERS = ("netns", "pidns", "mountns", "landlock", "seccomp", "drop", "audit")
"""What ``disable`` may name (tests: each layer shown to hold alone, or the others without it)."""
ISOLATION = ("network_namespace", "pid_namespace", "landlock", "seccomp")
"""What ``require_isolation`` requires of the kernel."""
MAX_MSG = 1 << 20


@dataclass(frozen=True)
class ToolResult:
    status: str
    """One of :data:`STATUSES`."""
    output: str
    """What the model is shown (before the caller's token limit)."""


def _stop(proc: subprocess.Popen, sock: socket.socket, root: str) -> None:
    try:
        sock.close()                         # the server sees EOF, kills its calls and exits
    except OSError:
        pass
    if proc.poll() is None:
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(root, ignore_errors=True)


class _Call:
    """A call in flight: the read end of its result pipe and what came back so far."""

    def __init__(self, fd: int, started: float):
        self.fd, self.data, self.done, self.flood, self.started = fd, bytearray(), None, False, started


class Sandbox:
    """Runs ``tool(call, sample) -> str`` (``module:function`` or ``file.py:function``) sandboxed.

    ``disable`` leaves protection layers off (any of :data:`LAYERS`): for tests that check each
    layer alone."""

    def __init__(self, tool: str, *, timeout_s: float = 5.0, memory_mb: int = 512, file_mb: int = 8,
                 output_bytes: int = 16384, workers: int = 2, preload: list[str] | tuple[str, ...] = (),
                 require_isolation: bool = False, disable: tuple[str, ...] = ()):
        if not sys.platform.startswith("linux"):
            raise ToolError(f"the tool sandbox needs Linux (its layers are Linux's); this is {sys.platform}")
        unknown = sorted(set(disable) - set(LAYERS))
        if unknown:
            raise ToolError(f"unknown sandbox layer(s) {unknown}; known: {', '.join(LAYERS)}")
        self.tool = tool
        self.limits = {"timeout_s": float(timeout_s), "cpu_s": int(timeout_s) + 1,
                       "memory_mb": int(memory_mb), "file_mb": int(file_mb),
                       "output_bytes": int(output_bytes)}
        self.workers = max(1, int(workers))
        self.preload = list(preload)
        self.require_isolation = require_isolation
        self.disable = tuple(disable)
        self.protections: dict[str, Any] = {}
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._finalizer = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        """The fork server's process id (None when not running)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> dict[str, Any]:
        """Start the fork server (if not running); returns the protections in force."""
        if self._proc is not None and self._proc.poll() is None:
            return self.protections
        root = tempfile.mkdtemp(prefix="nanogrpo-sandbox-")
        os.chmod(root, 0o711)  # a child dropped to nobody reaches its own directory, lists none
        for sub in ("work", "fs"):
            os.mkdir(os.path.join(root, sub), 0o711)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-X", "utf8", str(ZYGOTE), str(theirs.fileno())],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, cwd=root, env=dict(ENV),
                                    start_new_session=True, close_fds=True, pass_fds=(theirs.fileno(),))
        except OSError as e:
            mine.close()
            shutil.rmtree(root, ignore_errors=True)
            raise ToolError(f"tool sandbox did not start ({e})") from None
        finally:
            theirs.close()
        self._proc, self._sock = proc, mine
        self._finalizer = weakref.finalize(self, _stop, proc, mine, root)
        init = {"sys_path": [p for p in sys.path if p], "tool": self.tool, "preload": self.preload,
                "limits": self.limits, "root": root, "workers": self.workers, "disable": list(self.disable),
                "parent_pid": os.getpid()}
        try:
            self._send(init)
            answer, _ = self._recv(time.monotonic() + 120)
        except (OSError, ToolError) as e:
            self.close()
            raise ToolError(f"tool sandbox did not start ({e})") from None
        if "error" in answer:
            self.close()
            raise ToolError(f"tool sandbox: {answer['error']}")
        self.protections = answer["protections"]
        missing = [k for k in ISOLATION if not self.protections.get(k)]
        if self.require_isolation and missing:
            self.close()
            raise ToolError("tools.require_isolation is set but the kernel did not allow "
                            f"{', '.join(missing)} (see nanogrpo/tools/sandbox.py); run where it does "
                            "or set it to false")
        return self.protections

    def close(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc = self._sock = self._finalizer = None

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def run(self, calls: list[tuple[str, dict]]) -> list[ToolResult]:
        """One :class:`ToolResult` per ``(call, sample)``, in order; never raises for what a call does.

        Each call's code and sample go straight to its own process (a memfd handed over with the
        ``run`` message), never through the server; its result comes back on a pipe of its own."""
        if not calls:
            return []
        self.start()
        results: dict[int, ToolResult] = {}
        queue, live = deque(range(len(calls))), {}
        max_read = self.limits["output_bytes"] * 6 + 65536   # JSON escaping can multiply the bytes
        patience = self.limits["timeout_s"] + 30.0           # a server silent longer than this is broken
        try:
            while queue or live:
                while queue and len(live) < self.workers:
                    i = queue.popleft()
                    live[i] = self._spawn(i, *calls[i])
                fds = {c.fd: i for i, c in live.items() if c.fd >= 0}
                left = min(c.started for c in live.values()) + patience - time.monotonic()
                if left <= 0:
                    raise ToolError("the tool sandbox stopped answering")
                ready, _, _ = select.select([self._sock, *fds], [], [], left)
                for fd in ready:
                    if fd is self._sock:
                        msg, _ = self._recv(time.monotonic() + 5)
                        c = live.get(msg.get("done"))
                        if c is not None:
                            c.done = msg
                        continue
                    c = live[fds[fd]]
                    chunk = os.read(fd, 65536)
                    c.data += chunk
                    if not chunk or len(c.data) > max_read:
                        os.close(c.fd)
                        c.fd = -1
                        if chunk:
                            c.flood = True
                            self._send({"kill": fds[fd]})
                for i, c in list(live.items()):
                    if c.done is not None and c.fd < 0:
                        results[i] = _result(c)
                        del live[i]
        except (OSError, ToolError, KeyError, TypeError, ValueError) as e:
            for c in live.values():
                if c.fd >= 0:
                    os.close(c.fd)
            log.warning("tool sandbox failed (%s); restarting it", e)
            self.restarts += 1
            self.close()
            lost = ToolResult("crash", "the tool sandbox failed; the call was not run")
            return [results.get(i, lost) for i in range(len(calls))]
        return [results[i] for i in range(len(calls))]

    def _spawn(self, i: int, call: str, sample: dict) -> _Call:
        payload = json.dumps({"call": call, "sample": _jsonable(sample)}).encode("utf-8")
        src = os.memfd_create("nanogrpo-call", os.MFD_CLOEXEC)
        r, w = os.pipe()
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(src, view):]
            os.lseek(src, 0, os.SEEK_SET)
            socket.send_fds(self._sock, [json.dumps({"run": i}).encode()], [src, w])
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(src)
            os.close(w)
        return _Call(r, time.monotonic())

    # ------------------------------------------------------------------ messages

    def _send(self, obj: dict) -> None:
        self._sock.sendall(json.dumps(obj).encode("utf-8"))

    def _recv(self, deadline: float) -> tuple[dict, list[int]]:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([self._sock], [], [], max(0.0, left))
        if not ready:
            raise ToolError("no answer from the tool sandbox in time")
        data, fds, _, _ = socket.recv_fds(self._sock, MAX_MSG, 4)
        for fd in fds:
            os.close(fd)
        if not data:
            raise ToolError(f"the tool sandbox exited (code {self._proc.poll()})")
        return json.loads(data.decode("utf-8")), fds


def _result(c: _Call) -> ToolResult:
    """A finished call's result: what its process sent back, or what the server saw of its end."""
    done = c.done
    if done.get("why") == "timeout":
        return ToolResult("timeout", "")
    if c.flood:
        return ToolResult("overflow", "")
    if done.get("why") == "crash":
        return ToolResult("crash", _clean(done.get("output", "")))
    try:
        res = json.loads(bytes(c.data).decode("utf-8"))
        return ToolResult(str(res["status"]), _clean(str(res["output"])))
    except (ValueError, KeyError, TypeError):
        pass
    sig, code = done.get("signal"), done.get("exit")
    if sig == "SIGSYS":
        return ToolResult("denied", "the tool process was stopped: it made a system call the sandbox forbids")
    if sig is not None:
        why = {"SIGXCPU": "it used up its CPU time", "SIGKILL": "it was killed (out of memory or a limit)",
               "SIGSEGV": "it crashed (segmentation fault)"}.get(sig, f"it died of signal {sig}")
    else:
        why = f"it exited with code {code} before finishing"
    return ToolResult("crash", f"the tool process stopped: {why}")


def describe(prot: dict[str, Any]) -> tuple[str, bool]:
    """The start-up line's account of :attr:`Sandbox.protections`, and whether a kernel layer is off."""
    on, off = [], []
    for key, name in (("network_namespace", "network namespace"), ("pid_namespace", "PID namespace"),
                      ("private_root", "private root"), ("seccomp", "seccomp")):
        (on if prot.get(key) else off).append(name)
    abi = int(prot.get("landlock") or 0)
    if abi:
        on.append(f"Landlock ABI {abi}" + ("" if abi >= 6 else " (signals not scoped)"))
    else:
        off.append("Landlock")
    on += [name for key, name in (("drop_privileges", "nobody"), ("audit_hook", "audit hook"),
                                  ("rlimits", "rlimits")) if prot.get(key)]
    text = "on: " + ", ".join(on) + (f"; OFF: {', '.join(off)}" if off else "")
    if prot.get("private_root_error"):
        text += f" ({prot['private_root_error']})"
    return text, bool(off)


def _jsonable(sample: dict) -> dict:
    return json.loads(json.dumps(sample, default=str))


def _clean(text: str) -> str:
    """Valid UTF-8 text (the child may print lone surrogates)."""
    return str(text).encode("utf-8", "replace").decode("utf-8")
