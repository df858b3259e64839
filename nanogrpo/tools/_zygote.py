"""The sandbox's fork server: run as a script (``python -I _zygote.py``) by :mod:`nanogrpo.tools.sandbox`.

Standard library only: it must start without the trainer's packages. Protocol on stdin/stdout:
length-prefixed JSON messages (4-byte big-endian length, then UTF-8 JSON).

1. The trainer sends ``init``: ``sys_path``, ``tool`` (``module:function`` or ``file.py:function``),
   ``preload`` (modules), ``limits``, ``root`` (a private directory for work dirs), ``workers``,
   ``disable`` (protection layers to leave off: tests only). The server moves into a new network
   namespace where it may, imports the tool and the preloads, probes Landlock and answers
   ``{"ready": true, "protections": {...}}`` or ``{"error": "..."}``.
2. Then, per message ``{"calls": [{"id", "call", "sample"}, ...]}``, it forks one child per call
   (at most ``workers`` at a time) and answers ``{"results": [{"id", "status", "output"}, ...]}``.

Each child: own session and process group; stdin/stdout/stderr on /dev/null; a fresh working
directory; privileges dropped to nobody when root; parent-death signal; no_new_privs; Landlock
(read-only Python and system library directories, read-write work directory, no TCP, no
signals or abstract sockets outside); rlimits (address space, CPU seconds, no new processes,
file size, open files, no core dumps); an audit hook; then ``tool(call, sample)`` with
``sys.stdout``/``sys.stderr`` captured up to a byte cap. The server kills the child's process
group at the wall-clock deadline and removes its working directory.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import io
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import sysconfig
import tempfile
import time
import traceback

NOBODY = 65534
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_FILE_RIGHTS_V1 = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


# --------------------------------------------------------------------------- messages

def read_msg(f) -> dict | None:
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return json.loads(f.read(n).decode("utf-8"))


def write_msg(f, obj) -> None:
    data = json.dumps(obj).encode("utf-8")
    f.write(struct.pack(">I", len(data)) + data)
    f.flush()


# --------------------------------------------------------------------------- protections

def new_network_namespace() -> bool:
    """Move this process (and so every child) into a network namespace with no interfaces up."""
    if not sys.platform.startswith("linux"):
        return False
    lc = libc()
    if os.geteuid() == 0:
        return lc.unshare(CLONE_NEWNET) == 0
    uid, gid = os.getuid(), os.getgid()
    if lc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    try:  # keep the same ids inside the namespace (unmapped ids would read as nobody)
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError:
        pass
    return True


def can_drop_privileges() -> bool:
    """Whether a child can switch to nobody here (some containers map no uid but root)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, code = os.waitpid(pid, 0)
    return os.WIFEXITED(code) and os.WEXITSTATUS(code) == 0


def landlock_abi() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    r = libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return int(r) if r > 0 else 0


def _fs_rights(abi: int) -> int:
    bits = 13 + (abi >= 2) + (abi >= 3) + (abi >= 5)     # REFER (2), TRUNCATE (3), IOCTL_DEV (5)
    return (1 << bits) - 1


def apply_landlock(abi: int, read_dirs: list[str], write_dir: str) -> None:
    """Restrict this process: read ``read_dirs``, read and write ``write_dir``, nothing else on the
    filesystem; no TCP bind or connect (ABI >= 4); no signals or abstract unix sockets to processes
    outside (ABI >= 6). Raises OSError if the kernel refuses."""
    lc = libc()
    handled = _fs_rights(abi)
    net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0
    attr = struct.pack("<QQQ", handled, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr[:size], size)
    fd = lc.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"landlock_create_ruleset: {os.strerror(e)}")
    try:
        file_rights = FS_FILE_RIGHTS_V1 | ((1 << 14) if abi >= 3 else 0) | ((1 << 15) if abi >= 5 else 0)
        rules = [(p, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR) for p in read_dirs] + [(write_dir, handled)]
        for path, rights in rules:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not os.path.isdir(path):
                    rights &= file_rights
                rule = ctypes.create_string_buffer(struct.pack("<Qi", rights, pfd), 12)
                if lc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(fd),
                              ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"landlock_add_rule {path}: {os.strerror(e)}")
            finally:
                os.close(pfd)
        if lc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"landlock_restrict_self: {os.strerror(e)}")
    finally:
        os.close(fd)


def read_only_dirs() -> list[str]:
    """The Python installation (stdlib, site-packages) and the system's shared libraries."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    kinds = ("stdlib", "platstdlib", "purelib", "platlib")
    paths |= {v for k, v in sysconfig.get_paths().items() if k in kinds}
    paths |= {"/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc/ld.so.cache", "/dev/null",
              "/dev/urandom", "/usr/share/zoneinfo"}
    return sorted(p for p in paths if p and os.path.exists(p) and os.path.realpath(p) != "/")


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


def child(fn, call: str, sample: dict, out_fd: int, work: str, limits: dict, prot: dict,
          read_dirs: list[str]):
    """Runs in the forked child; never returns."""
    status, text = "ok", ""
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, out_fd)
        os.closerange(out_fd + 1, 65536)
        os.chdir(work)
        linux = sys.platform.startswith("linux")
        if linux:
            libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if prot.get("landlock"):  # before dropping privileges: nobody may not reach the directories
            apply_landlock(prot["landlock"], read_dirs, work)
        if prot.get("drop_privileges"):
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        if linux:  # after the uid change, which clears it
            libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != prot["server_pid"]:
                os._exit(70)
        mem = int(limits["memory_mb"]) << 20
        cpu = int(limits["cpu_s"])
        for res, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_FSIZE, int(limits["file_mb"]) << 20), (resource.RLIMIT_NOFILE, 64),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
            soft, hard = val if isinstance(val, tuple) else (val, val)
            resource.setrlimit(res, (soft, hard))
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
        status = "error"
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

def run_calls(fn, calls: list[dict], init: dict, prot: dict, read_dirs: list[str]) -> list[dict]:
    limits = init["limits"]
    workers = max(1, int(init["workers"]))
    max_read = int(limits["output_bytes"]) * 6 + 65536     # JSON escaping can multiply the bytes
    pending = list(calls)
    running: dict[int, dict] = {}                          # read fd -> state
    results: list[dict] = []
    while pending or running:
        while pending and len(running) < workers:
            c = pending.pop(0)
            work = tempfile.mkdtemp(prefix="call-", dir=init["root"])
            if prot.get("drop_privileges"):
                os.chown(work, NOBODY, NOBODY)
            r, w = os.pipe()
            try:
                pid = os.fork()
            except OSError as e:
                os.close(r)
                os.close(w)
                shutil.rmtree(work, ignore_errors=True)
                results.append({"id": c["id"], "status": "crash",
                                "output": f"the sandbox could not fork ({e})"})
                continue
            if pid == 0:
                os.close(r)
                child(fn, c["call"], c.get("sample") or {}, w, work, limits, prot, read_dirs)
            os.close(w)
            running[r] = {"id": c["id"], "pid": pid, "work": work, "data": bytearray(),
                          "deadline": time.monotonic() + float(limits["timeout_s"]), "why": None}
        wait = max(0.0, min(s["deadline"] for s in running.values()) - time.monotonic())
        ready, _, _ = select.select(list(running), [], [], wait)
        for r in ready:
            s = running[r]
            try:
                chunk = os.read(r, 65536)
            except OSError:
                chunk = b""
            if chunk:
                s["data"] += chunk
                if len(s["data"]) > max_read:
                    s["why"] = "flood"
                    _kill(s["pid"])
                else:
                    continue
            results.append(_finish(r, running.pop(r)))
        now = time.monotonic()
        for r, s in list(running.items()):
            if now >= s["deadline"]:
                s["why"] = "timeout"
                _kill(s["pid"])
                results.append(_finish(r, running.pop(r)))
    return results


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except OSError:
            pass


def _finish(r: int, s: dict) -> dict:
    os.close(r)
    if s["why"] is not None:
        _kill(s["pid"])
    _, code = os.waitpid(s["pid"], 0)
    shutil.rmtree(s["work"], ignore_errors=True)
    if s["why"] == "timeout":
        return {"id": s["id"], "status": "timeout", "output": ""}
    if s["why"] == "flood":
        return {"id": s["id"], "status": "overflow", "output": ""}
    try:
        res = json.loads(bytes(s["data"]).decode("utf-8"))
        return {"id": s["id"], "status": str(res["status"]), "output": str(res["output"])}
    except (ValueError, KeyError, TypeError):
        pass
    if os.WIFSIGNALED(code):
        sig = os.WTERMSIG(code)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        why = {"SIGXCPU": "it used up its CPU time", "SIGKILL": "it was killed (out of memory or a limit)",
               "SIGSEGV": "it crashed (segmentation fault)"}.get(name, f"it died of signal {name}")
    else:
        why = f"it exited with code {os.WEXITSTATUS(code)} before finishing"
    return {"id": s["id"], "status": "crash", "output": f"the tool process stopped: {why}"}


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the message stream
    init = read_msg(stdin)
    if init is None:
        return 1
    disable = set(init.get("disable", ()))
    prot = {"server_pid": os.getpid()}
    if sys.platform.startswith("linux"):
        libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != int(init["parent_pid"]):
            return 1
    prot["network_namespace"] = "netns" not in disable and new_network_namespace()
    prot["drop_privileges"] = "drop" not in disable and os.geteuid() == 0 and can_drop_privileges()
    prot["landlock"] = 0 if "landlock" in disable else landlock_abi()
    prot["audit_hook"] = "audit" not in disable
    prot["rlimits"] = True
    try:
        sys.path[:] = [p for p in init["sys_path"] if isinstance(p, str)]
        for name in init.get("preload", ()):
            importlib.import_module(name)
        fn = _load_tool(init["tool"])
        if not callable(fn):
            raise TypeError(f"{init['tool']} is not callable")
    except BaseException as e:
        write_msg(stdout, {"error": f"cannot load tool {init['tool']!r}: {type(e).__name__}: {e}"})
        return 1
    read_dirs = read_only_dirs()
    write_msg(stdout, {"ready": True, "protections": {k: v for k, v in prot.items() if k != "server_pid"}})
    while True:
        msg = read_msg(stdin)
        if msg is None:
            return 0
        write_msg(stdout, {"results": run_calls(fn, msg["calls"], init, prot, read_dirs)})


if __name__ == "__main__":
    sys.exit(main())
