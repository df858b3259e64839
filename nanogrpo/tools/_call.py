"""A sandboxed call's process: its lock-down and the tool's run, loaded by path by the fork server
(:mod:`nanogrpo.tools._zygote`, which forks the process and calls :func:`child` in it). Standard library
only, as the server.

:func:`child` reads the call from its input descriptor, puts stdin/stdout/stderr on ``/dev/null``,
closes every other descriptor but its result pipe, enters its empty working directory, then locks
itself down in this order: no new privileges, Landlock, privileges dropped to nobody (when root), every
capability dropped, not dumpable, parent-death signal, rlimits, the seccomp filter, the audit hook
(:func:`install_audit_hook`: defence in depth, not a boundary). Only then does it run
``tool(call, sample)`` with its output captured up to a byte cap, and write ``{"status", "output"}``
back on the pipe.
"""

from __future__ import annotations

import errno
import io
import json
import os
import resource
import signal
import sys
import traceback

NOBODY = 65534


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


def child(kernel, fn, in_fd: int, out_fd: int, work: str, limits: dict, prot: dict, read_dirs: list[str],
          server_pid: int, filt):
    """Runs in the forked child (``kernel``: the server's ``_kernel`` module); never returns."""
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
