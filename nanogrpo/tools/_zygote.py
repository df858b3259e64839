"""The sandbox's fork server: run as a script (``python -I _zygote.py FD``) by :mod:`nanogrpo.tools.sandbox`.

Standard library only: it must start without the trainer's packages (its siblings ``_kernel.py`` and
``_seccomp.py`` are loaded by path). It talks to the trainer over the ``AF_UNIX`` ``SOCK_SEQPACKET``
socket ``FD``, one JSON object per message:

1. ``init`` from the trainer: ``sys_path``, ``tool`` (``module:function`` or ``file.py:function``),
   ``preload`` (modules), ``limits``, ``root`` (a private directory: ``work/`` for the calls'
   directories, ``fs/`` for the private root), ``disable`` (layers to leave off: tests only),
   ``parent_pid``. The server enters its namespaces, imports the tool and the preloads, builds
   its private root, probes the other layers and answers ``{"ready": true, "protections": {...}}``
   or ``{"error": "..."}``.
2. ``{"run": id}`` carrying two file descriptors: the call's input (a memfd the trainer wrote
   ``{"call", "sample"}`` into) and the write end of the pipe its result goes back on. The
   server forks the call's process at once, hands it the two descriptors and closes its own
   copies: **the call's code and sample never pass through the server's memory**, so no call's
   process (a copy of the server) holds anything of another call. ``{"kill": id}`` ends a call.
3. ``{"done": id, "why": null | "timeout" | "killed", "exit": code | null, "signal": name | null}``
   from the server when a call's process is gone (it is killed at the wall-clock deadline).

The server itself: not dumpable; in new network and mount namespaces (inside a user namespace when
not root), pivoted into its private root; pid 1 of a PID namespace, under an outer process that
only waits for it. Each call's process: its own PID namespace (it is pid 1 and sees no other
process), its own session; stdin/stdout/stderr on /dev/null, no other descriptor but its result
pipe; an empty working directory (a tmpfs of its own under the private root, reused once
emptied); Landlock; privileges dropped to nobody when root, every capability dropped; not
dumpable; parent-death signal; rlimits (address space, CPU seconds, no new processes, file size,
open files, no core dumps); the seccomp filter (``_seccomp.py``); an audit hook; then
``tool(call, sample)`` with ``sys.stdout``/``sys.stderr`` captured up to a byte cap.
The call's process is :mod:`nanogrpo.tools._call` (loaded by path, as ``_kernel.py`` and ``_seccomp.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

NOBODY = 65534
MAX_MSG = 1 << 20
HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_nanogrpo_sandbox_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kernel = _sibling("_kernel")
seccomp = _sibling("_seccomp")
call_process = _sibling("_call")


# --------------------------------------------------------------------------- messages

def send(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode("utf-8"))


def recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MSG, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data.decode("utf-8")), fds


# --------------------------------------------------------------------------- the tool

def _load_tool(spec: str):
    module, _, attr = spec.rpartition(":")
    if module.endswith(".py") or "/" in module:
        file_spec = importlib.util.spec_from_file_location("_nanogrpo_tool", os.path.abspath(module))
        mod = importlib.util.module_from_spec(file_spec)
        sys.modules["_nanogrpo_tool"] = mod
        file_spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    return getattr(mod, attr)



# --------------------------------------------------------------------------- the server

class Server:
    """Forks one process per ``run`` message, kills it at its deadline, reports when it is gone."""

    def __init__(self, sock: socket.socket, fn, init: dict, prot: dict, read_dirs: list[str],
                 pidns_fd: int | None, filt):
        self.sock, self.fn, self.init, self.prot, self.read_dirs = sock, fn, init, prot, read_dirs
        self.filt = filt
        self.limits = init["limits"]
        self.work_root = os.path.join(init["root"], "work")
        self.pidns_fd = pidns_fd
        self.running: dict[int, dict] = {}     # pid -> {"id", "deadline", "work", "why"}
        self.disks: list[str] = []             # free per-call tmpfs directories (private root only)
        if prot.get("private_root"):           # mounted once: an unmount per call cost ~4 ms
            owner = f",uid={NOBODY},gid={NOBODY}" if prot.get("drop_privileges") else ""
            for i in range(max(1, int(init["workers"]))):
                path = os.path.join(self.work_root, f"disk-{i}")
                os.mkdir(path, 0o700)
                kernel.mount_tmpfs(path, 4 * max(1, int(self.limits["file_mb"])) + 4, owner)
                self.disks.append(path)

    def _work_dir(self) -> str:
        """A call's directory: an empty tmpfs of its own (the calls share no disk space), or a fresh
        directory beside the trainer's files without the private root."""
        if self.disks:
            return self.disks.pop()
        work = tempfile.mkdtemp(prefix="call-", dir=self.work_root)
        if self.prot.get("drop_privileges"):
            os.chown(work, NOBODY, NOBODY)
        return work

    def _release(self, work: str) -> None:
        """Empty a call's tmpfs for the next call (or remove its directory)."""
        if not os.path.basename(work).startswith("disk-"):
            kernel.remove_tree(work)
            return
        try:
            os.chmod(work, 0o700)
            for name in os.listdir(work):
                path = os.path.join(work, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    kernel.remove_tree(path)
                else:
                    os.unlink(path)
            if not os.listdir(work):
                self.disks.append(work)     # else it stays out of use: never reused half-empty
        except OSError:
            pass

    def spawn(self, cid, fds: list[int]) -> None:
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            send(self.sock, {"done": cid, "why": "crash", "exit": None, "signal": None,
                             "output": "the call came without its two descriptors"})
            return
        in_fd, out_fd = fds
        work = None
        try:
            work = self._work_dir()
            if self.pidns_fd is not None:
                kernel.unshare(kernel.CLONE_NEWPID)   # the next child: pid 1 of a namespace of its own
            pid = -1
            try:
                pid = os.fork()
            finally:
                if self.pidns_fd is not None and pid != 0:
                    kernel.setns(self.pidns_fd, kernel.CLONE_NEWPID)
        except OSError as e:
            os.close(in_fd)
            os.close(out_fd)
            if work is not None:
                self._release(work)
            send(self.sock, {"done": cid, "why": "crash", "exit": None, "signal": None,
                             "output": f"the sandbox could not start the call ({e})"})
            return
        if pid == 0:
            self.running.clear()           # the child keeps nothing of the other calls
            call_process.child(kernel, self.fn, in_fd, out_fd, work, self.limits, self.prot, self.read_dirs,
                  self.init["server_pid"], self.filt)
        os.close(in_fd)
        os.close(out_fd)
        self.running[pid] = {"id": cid, "work": work, "why": None,
                             "deadline": time.monotonic() + float(self.limits["timeout_s"])}

    def kill(self, pid: int, why: str) -> None:
        s = self.running[pid]
        if s["why"] is None:
            s["why"] = why
        for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
            except OSError:
                pass

    def reap(self) -> None:
        while self.running:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            s = self.running.pop(pid, None)
            if s is None:
                continue
            self._release(s["work"])
            sig = None
            if os.WIFSIGNALED(code):
                try:
                    sig = signal.Signals(os.WTERMSIG(code)).name
                except ValueError:
                    sig = str(os.WTERMSIG(code))
            send(self.sock, {"done": s["id"], "why": s["why"], "signal": sig,
                             "exit": os.WEXITSTATUS(code) if os.WIFEXITED(code) else None})

    def serve(self) -> int:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        while True:
            now = time.monotonic()
            for pid, s in list(self.running.items()):
                if now >= s["deadline"] and s["why"] is None:
                    self.kill(pid, "timeout")
            waits = [s["deadline"] - now for s in self.running.values() if s["why"] is None]
            ready, _, _ = select.select([self.sock, wake_r], [], [], max(0.0, min(waits)) if waits else None)
            if wake_r in ready:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            self.reap()
            if self.sock in ready:
                msg, fds = recv(self.sock)
                if msg is None:                       # the trainer is gone
                    for pid in list(self.running):
                        self.kill(pid, "killed")
                    return 0
                if "run" in msg:
                    self.spawn(msg["run"], fds)
                elif "kill" in msg:
                    for pid, s in list(self.running.items()):
                        if s["id"] == msg["kill"]:
                            self.kill(pid, "killed")


def _probe(fn) -> bool:
    """Whether ``fn()`` works in a throwaway child (a layer the kernel may refuse)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, code = os.waitpid(pid, 0)
    return os.WIFEXITED(code) and os.WEXITSTATUS(code) == 0


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sys.stdout = sys.stderr  # a stray print must not corrupt anything
    init, _ = recv(sock)
    if init is None:
        return 1
    linux = sys.platform.startswith("linux")
    disable = set(init.get("disable", ()))
    init["server_pid"] = os.getpid()
    if linux:
        kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != int(init["parent_pid"]):
            return 1
    want = {n for n, key in (("net", "netns"), ("mount", "mountns"), ("pid", "pidns")) if key not in disable}
    ns = kernel.enter_namespaces(want)         # (writes its own /proc files: while still dumpable)
    if linux:
        kernel.prctl(kernel.PR_SET_DUMPABLE, 0)   # no process of this uid reads or traces the server
    pidns_fd = None
    if ns["pid"]:
        inner = os.fork()
        if inner:                          # the outer process only waits for the server (pid 1)
            sock.close()
            _, code = os.waitpid(inner, 0)
            return os.WEXITSTATUS(code) if os.WIFEXITED(code) else 1
        kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)
        init["server_pid"] = os.getpid()
        try:
            pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            kernel.unshare(kernel.CLONE_NEWPID)                 # can the calls get their own?
            kernel.setns(pidns_fd, kernel.CLONE_NEWPID)
        except OSError:
            if pidns_fd is not None:
                os.close(pidns_fd)
            pidns_fd = None
    prot = {"user_namespace": ns["user"], "network_namespace": ns["net"],
            "pid_namespace": pidns_fd is not None, "private_root": False}
    prot["drop_privileges"] = "drop" not in disable and os.geteuid() == 0 and _probe(_drop_to_nobody)
    prot["landlock"] = 0 if "landlock" in disable else kernel.landlock_abi()
    try:
        sys.path[:] = [p for p in init["sys_path"] if isinstance(p, str)]
        for name in init.get("preload", ()):
            importlib.import_module(name)
        fn = _load_tool(init["tool"])
        if not callable(fn):
            raise TypeError(f"{init['tool']} is not callable")
    except BaseException as e:
        send(sock, {"error": f"cannot load tool {init['tool']!r}: {type(e).__name__}: {e}"})
        return 1
    read_dirs = kernel.read_only_dirs()
    if ns["mount"]:
        try:
            root = init["root"]
            kernel.private_root(read_dirs, os.path.join(root, "work"), os.path.join(root, "fs"))
            prot["private_root"] = True
        except OSError as e:
            prot["private_root_error"] = str(e)
    filt = seccomp.Filter() if "seccomp" not in disable and linux and seccomp.arch() is not None else None
    prot["seccomp"] = filt is not None and _probe(lambda: filt.install(kernel.libc()))
    filt = filt if prot["seccomp"] else None
    prot["audit_hook"] = "audit" not in disable
    prot["rlimits"] = True
    send(sock, {"ready": True, "protections": prot})
    return Server(sock, fn, init, prot, read_dirs, pidns_fd, filt).serve()


if __name__ == "__main__":
    sys.exit(main())
