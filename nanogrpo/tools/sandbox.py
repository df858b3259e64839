"""A sandbox for tool calls written by the model: every call in a fresh, locked-down process.

:class:`Sandbox` starts one *fork server* (``python -I nanogrpo/tools/_zygote.py``, standard
library only) with an environment of five fixed variables (none of the trainer's), in its own
session, in a private directory. The server imports the tool function (and ``preload`` modules)
once, then forks a child per call, at most ``workers`` at a time; the child locks itself down,
runs ``tool(call, sample)``, sends back what it printed and returned (up to ``output_bytes``) and
exits. A tool that raises, hangs, crashes, floods its output or breaks a limit gives the model an
error text and a status (``error``, ``timeout``, ``crash``, ``overflow``) that the caller counts;
the server and the run carry on. A server that dies or stops answering is killed and restarted;
its calls get ``crash``.

What is guaranteed (Linux), whatever the code does:

- **a fresh process per call**, forked from the server (never from the trainer), with its own
  session and process group, killed as a group (SIGKILL) at ``timeout_s`` of wall-clock time;
  ``RLIMIT_CPU`` stops it after about as much CPU time;
- **limits** (rlimits, set before the code runs): address space ``memory_mb``, file size
  ``file_mb``, 64 open files, no core dumps, and ``RLIMIT_NPROC = 0``: no new process or
  thread (a fork bomb stops at the first fork). Linux exempts root from ``RLIMIT_NPROC``, hence:
- **privileges dropped**: when the trainer runs as root, each child switches to uid/gid 65534
  (``nobody``) with no supplementary groups, after ``PR_SET_NO_NEW_PRIVS``;
- **no environment**: ``os.environ`` holds only ``PATH``, ``LANG``, ``OMP_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``; ``python -I`` ignores ``PYTHON*`` variables
  and the user site directory;
- **a throwaway working directory**, removed after the call; stdin, stdout and stderr are
  ``/dev/null`` (output goes through a capped in-process buffer, ``output_bytes``);
- **the output is capped**: past ``output_bytes`` the tool is stopped and the model gets the first
  ``output_bytes`` and a note; the server also kills a child that writes more than it should.

Where the kernel allows it (reported by :attr:`Sandbox.protections`; ``require_isolation``
refuses to start without the first two):

- **no network**: the server moves into a new network namespace (``unshare(CLONE_NEWNET)``;
  as non-root with a user namespace) before forking anything: no interface but a loopback
  that is down, so no packet leaves, TCP or UDP, not even to the host's localhost;
- **no files but its own** (Landlock, Linux >= 5.13): read-only access to the Python
  installation (prefixes, stdlib, site-packages) and system library directories, read-write
  access to its working directory, nothing else: not the trainer's files, not ``/proc`` (so
  not another process's environment), not the home directory. Landlock ABI >= 4 also denies TCP
  bind/connect, ABI >= 6 signals and abstract unix sockets to processes outside the sandbox.

Defence in depth, never a boundary: an audit hook (PEP 578) in the child refuses sockets, new
processes, signals, ``ctypes`` calls and file access outside those directories, which covers
plain Python code where the kernel features are missing; code that reaches C (``ctypes``
before the hook, a C extension) can get around it.

Not guaranteed: isolation from kernel exploits; a disk-space quota (``file_mb`` bounds each
file, ``timeout_s`` the time to write them, and the directory is deleted after); CPU or memory
shares between concurrent children beyond their own rlimits. Without a network namespace
(unprivileged and no user namespaces) UDP is blocked only by the audit hook; without Landlock
files only by the audit hook (and by dropping to ``nobody`` when root). Modules that are not
preloaded are imported by the child itself: as ``nobody`` it can read only world-readable
installations (list what the tool's code imports in ``preload``). Needs Linux (or another
POSIX system, with fewer layers); not Windows.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogrpo.errors import ToolError

log = logging.getLogger("nanogrpo.tools")

ZYGOTE = Path(__file__).with_name("_zygote.py")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
STATUSES = ("ok", "error", "timeout", "crash", "overflow", "invalid")
"""``invalid`` is the caller's: a malformed call that never reached the sandbox."""


@dataclass(frozen=True)
class ToolResult:
    status: str
    """One of :data:`STATUSES`."""
    output: str
    """What the model is shown (before the caller's token limit)."""


def _stop(proc: subprocess.Popen, root: str) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.close()
            proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass
    shutil.rmtree(root, ignore_errors=True)


class Sandbox:
    """Runs ``tool(call, sample) -> str`` (``module:function`` or ``file.py:function``) sandboxed.

    ``disable`` leaves protection layers off (``netns``, ``landlock``, ``drop``, ``audit``): for
    tests that check each layer alone."""

    def __init__(self, tool: str, *, timeout_s: float = 5.0, memory_mb: int = 512, file_mb: int = 8,
                 output_bytes: int = 16384, workers: int = 2, preload: list[str] | tuple[str, ...] = (),
                 require_isolation: bool = False, disable: tuple[str, ...] = ()):
        if os.name != "posix":
            raise ToolError("the tool sandbox needs a POSIX system (Linux for every protection); "
                            f"this is {sys.platform}")
        self.tool = tool
        self.limits = {"timeout_s": float(timeout_s), "cpu_s": int(timeout_s) + 1,
                       "memory_mb": int(memory_mb), "file_mb": int(file_mb),
                       "output_bytes": int(output_bytes)}
        self.workers = int(workers)
        self.preload = list(preload)
        self.require_isolation = require_isolation
        self.disable = tuple(disable)
        self.protections: dict[str, Any] = {}
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._root: str | None = None
        self._finalizer = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> dict[str, Any]:
        """Start the fork server (if not running); returns the protections in force."""
        if self._proc is not None and self._proc.poll() is None:
            return self.protections
        root = tempfile.mkdtemp(prefix="nanogrpo-sandbox-")
        os.chmod(root, 0o711)  # a child dropped to nobody reaches its own directory, lists none
        proc = subprocess.Popen([sys.executable, "-I", "-X", "utf8", str(ZYGOTE)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=root, env=dict(ENV),
                                start_new_session=True, close_fds=True)
        self._proc, self._root = proc, root
        self._finalizer = weakref.finalize(self, _stop, proc, root)
        init = {"sys_path": [p for p in sys.path if p], "tool": self.tool, "preload": self.preload,
                "limits": self.limits, "root": root, "workers": self.workers, "disable": list(self.disable),
                "parent_pid": os.getpid()}
        try:
            self._send(init)
            answer = self._recv(time.monotonic() + 120)
        except (OSError, ToolError) as e:
            self.close()
            raise ToolError(f"tool sandbox did not start ({e})") from None
        if "error" in answer:
            self.close()
            raise ToolError(f"tool sandbox: {answer['error']}")
        self.protections = answer["protections"]
        missing = [k for k in ("network_namespace", "landlock") if not self.protections.get(k)]
        if self.require_isolation and missing:
            self.close()
            raise ToolError("tools.require_isolation is set but the kernel did not allow "
                            f"{' and '.join(missing)} (see nanogrpo/tools/sandbox.py); run where it does "
                            "or set it to false")
        return self.protections

    def close(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc = self._finalizer = None

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def run(self, calls: list[tuple[str, dict]]) -> list[ToolResult]:
        """One :class:`ToolResult` per ``(call, sample)``, in order; never raises for what a call does."""
        if not calls:
            return []
        self.start()
        msg = {"calls": [{"id": i, "call": c, "sample": _jsonable(s)} for i, (c, s) in enumerate(calls)]}
        waves = -(-len(calls) // max(1, self.workers))
        deadline = time.monotonic() + waves * (self.limits["timeout_s"] + 2.0) + 30.0
        try:
            self._send(msg)
            answer = self._recv(deadline)
            got = {r["id"]: ToolResult(r["status"], _clean(r["output"])) for r in answer["results"]}
            if len(got) != len(calls):
                raise ToolError(f"the tool sandbox answered {len(got)} of {len(calls)} calls")
        except (OSError, ToolError, KeyError, TypeError) as e:
            log.warning("tool sandbox failed (%s); restarting it", e)
            self.restarts += 1
            self.close()
            return [ToolResult("crash", "the tool sandbox failed; the call was not run")] * len(calls)
        return [got[i] for i in range(len(calls))]

    # ------------------------------------------------------------------ messages

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode("utf-8")
        self._proc.stdin.write(struct.pack(">I", len(data)) + data)
        self._proc.stdin.flush()

    def _recv(self, deadline: float) -> dict:
        head = self._read(4, deadline)
        (n,) = struct.unpack(">I", head)
        return json.loads(self._read(n, deadline).decode("utf-8"))

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self._proc.stdout.fileno()
        out = bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ToolError("no answer from the tool sandbox in time")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise ToolError(f"the tool sandbox exited (code {self._proc.poll()})")
            out += chunk
        return bytes(out)


def _jsonable(sample: dict) -> dict:
    return json.loads(json.dumps(sample, default=str))


def _clean(text: str) -> str:
    """Valid UTF-8 text (the child may print lone surrogates)."""
    return str(text).encode("utf-8", "replace").decode("utf-8")
