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
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import io
import json
import os
import resource
import select
import signal
import socket
import sys
import tempfile
import time
import traceback
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


# --------------------------------------------------------------------------- defence in depth

def install_audit_hook(read_dirs: list[str], work: str) -> None:
    """Defence in depth, not a boundary (code with ctypes or a C extension can get around it): refuse
    sockets, new processes, signals, ctypes calls, and file access outside the allowed directories."""
    roots_r = tuple(os.path.realpath(p) for p in read_dirs)
    work = os.path.realpath(work)
    deny_prefix = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                   "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.", "pty.", "urllib.", "http.",
                   "ftplib.", "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.", "webbrowser.",
                   "os.system", "os.startfile", "sys.setprofile", "sys.settrace", "sys._current_frames")
    writes = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate",
              "os.chmod", "os.chown", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
    reads = {"os.listdir", "os.scandir", "glob.glob", "os.chdir"}

    def inside(path, roots) -> bool:
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event, args):
        if event.startswith(deny_prefix):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode = args[0], args[1]
            if isinstance(path, int) or path is None:
                return
            write = mode is not None and any(c in str(mode) for c in "wax+")
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            write = write or bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if not inside(path, (work,) if write else (work, *roots_r)):
                raise PermissionError(f"sandbox: access to {os.fsdecode(path)!r} is not allowed")
        elif event in writes:
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a, (work,)):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
        elif event in reads:
            a = args[0] if args else "."
            if isinstance(a, (str, bytes, os.PathLike)) and not inside(a, (work, *roots_r)):
                raise PermissionError(f"sandbox: {event} of {os.fsdecode(a)!r} is not allowed")

    sys.addaudithook(hook)


# --------------------------------------------------------------------------- the child

class OutputLimit(BaseException):
    """Raised in the tool when its output passes the byte cap (a BaseException: ``except Exception``
    in the tool's code does not swallow it)."""


class CappedWriter(io.TextIOBase):
    def __init__(self, cap: int):
        self.cap, self.parts, self.size, self.overflow = cap, [], 0, False

    def writable(self) -> bool:
        return True

    def write(self, s) -> int:
        s = str(s)
        room = self.cap - self.size
        if len(s.encode("utf-8", "replace")) > room:
            cut = s.encode("utf-8", "replace")[:max(room, 0)].decode("utf-8", "ignore")
            self.parts.append(cut)
            self.size = self.cap
            self.overflow = True
            raise OutputLimit()
        self.parts.append(s)
        self.size += len(s.encode("utf-8", "replace"))
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


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


def _short_traceback(e: BaseException, fn) -> str:
    """The exception with the frames of the code that raised it, not this harness's (nor the tool
    function's own when it asks so with ``hide_own_frames``: the built-in Python tool)."""
    if isinstance(e, SyntaxError):
        return "".join(traceback.format_exception_only(type(e), e))[-2000:]
    hidden = {__file__}
    if getattr(fn, "hide_own_frames", False):
        hidden.add(fn.__code__.co_filename)
    te = traceback.TracebackException(type(e), e, e.__traceback__)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename not in hidden])
    return "".join(te.format())[-2000:]


def _refused(e: BaseException) -> bool:
    """An error only the sandbox causes: a refusal, a process out of reach (the call sees none but
    itself), the read-only private root."""
    return isinstance(e, (PermissionError, ProcessLookupError)) or \
        (isinstance(e, OSError) and e.errno == errno.EROFS)


def child(fn, in_fd: int, out_fd: int, work: str, limits: dict, prot: dict, read_dirs: list[str],
          server_pid: int, filt):
    """Runs in the forked child; never returns."""
    status, text = "ok", ""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        payload = b""
        while chunk := os.read(in_fd, 1 << 20):
            payload += chunk
        os.close(in_fd)
        msg = json.loads(payload.decode("utf-8"))
        del payload
        call, sample = msg["call"], msg.get("sample") or {}
        del msg
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        if devnull > 2:
            os.close(devnull)
        os.closerange(3, out_fd)
        os.closerange(out_fd + 1, 1 << 20)
        os.chdir(work)
        os.environ["TMPDIR"] = os.environ["HOME"] = work
        linux = sys.platform.startswith("linux")
        if linux:
            kernel.prctl(kernel.PR_SET_NO_NEW_PRIVS, 1)
        if prot.get("landlock"):  # before dropping privileges: nobody may not reach the directories
            kernel.apply_landlock(prot["landlock"], read_dirs, work)
        if prot.get("drop_privileges"):
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        if linux:  # every capability: those a user namespace grants, root's where nobody is not an option
            kernel.drop_capabilities()
            # after the uid change, which resets both:
            kernel.prctl(kernel.PR_SET_DUMPABLE, 0)       # no process of this uid reads or traces it
            kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)
            if not prot.get("pid_namespace") and os.getppid() != server_pid:
                os._exit(70)
        mem = int(limits["memory_mb"]) << 20
        cpu = int(limits["cpu_s"])
        for res, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_FSIZE, int(limits["file_mb"]) << 20), (resource.RLIMIT_NOFILE, 64),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
            soft, hard = val if isinstance(val, tuple) else (val, val)
            resource.setrlimit(res, (soft, hard))
        if filt is not None:
            filt.install(kernel.libc())
        if prot.get("audit_hook"):
            install_audit_hook(read_dirs, work)
    except BaseException as e:  # the sandbox could not be set up: run nothing
        msg = f"sandbox setup failed: {type(e).__name__}: {e}"
        os.write(out_fd, json.dumps({"status": "crash", "output": msg}).encode())
        os._exit(71)
    cap = int(limits["output_bytes"])
    buf = CappedWriter(cap)
    sys.stdout = sys.stderr = buf
    try:
        ret = fn(call, sample)
        if ret is not None:
            buf.write(ret if isinstance(ret, str) else repr(ret))
    except OutputLimit:
        status = "overflow"
    except SystemExit as e:
        if e.code not in (None, 0):
            status = "error"
            try:
                buf.write(f"SystemExit: {e.code}\n")
            except OutputLimit:
                status = "overflow"
    except BaseException as e:  # anything the tool raises goes back to the model as text
        status = "denied" if _refused(e) else "error"
        try:
            buf.write(_short_traceback(e, fn))
        except OutputLimit:
            pass
    text = buf.text()
    if buf.overflow:
        status = "overflow"
    data = json.dumps({"status": status, "output": text}).encode("utf-8", "replace")
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(out_fd, view):]
    except OSError:
        pass
    os._exit(0)


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
            child(self.fn, in_fd, out_fd, work, self.limits, self.prot, self.read_dirs,
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
