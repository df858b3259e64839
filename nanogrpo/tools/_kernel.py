"""The kernel layers of the sandbox: namespaces, a private root, Landlock, capabilities.

Standard library only (the fork server loads it by path); Linux system calls through ``ctypes``.
Each function either does what it says or raises ``OSError`` (the server reports the layer off).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import sys
import sysconfig

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = \
    1, 2, 4, 8, 32, 4096, 0x4000, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT = 1, 4, 38, 24, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
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


def _ok(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def prctl(option: int, arg: int = 0) -> int:
    return _ok(libc().prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                            ctypes.c_ulong(0)), f"prctl({option})")


def unshare(flags: int) -> None:
    _ok(libc().unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    _ok(libc().setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


# --------------------------------------------------------------------------- namespaces

def enter_namespaces(want: set[str]) -> dict[str, bool]:
    """Move this process into new network / mount namespaces and make its next child the first of a
    new PID namespace (``want``: ``net``, ``mount``, ``pid``), each where the kernel allows. Not
    root: inside a new user namespace that maps only this uid and gid (the process keeps its ids,
    with capabilities over the new namespaces alone). Returns which namespaces are in force."""
    got = {"user": False, "net": False, "mount": False, "pid": False}
    if not sys.platform.startswith("linux") or not want:
        return got
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        try:
            unshare(CLONE_NEWUSER)
        except OSError:
            return got  # no user namespaces here (e.g. AppArmor's restriction on Ubuntu 23.10+)
        got["user"] = True
        try:
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
        except OSError:
            return got  # unmapped ids: the other namespaces would not work as meant
    for name, flag in (("net", CLONE_NEWNET), ("mount", CLONE_NEWNS), ("pid", CLONE_NEWPID)):
        if name in want:
            try:
                unshare(flag)
                got[name] = True
            except OSError:
                pass
    return got


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else os.fsencode(s))
    _ok(libc().mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def mount_tmpfs(target: str, size_mb: int, options: str = "") -> None:
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={size_mb}m{options}")


def _remount_read_only(target: str) -> None:
    """Read-only bind remount keeping the flags the kernel locks (nosuid, nodev, noexec)."""
    st = os.statvfs(target)
    keep = 0
    for st_flag, ms_flag in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
        if st.f_flag & st_flag:
            keep |= ms_flag
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def private_root(read_paths: list[str], write_dir: str, new_root: str) -> None:
    """Replace this mount namespace's root by an empty read-only tmpfs (``new_root``, an empty
    directory) holding only read-only binds of ``read_paths`` and a read-write bind of
    ``write_dir``, each at its own path: no /proc, /sys, /tmp, /home, no trainer file. Call it in a
    private mount namespace, with rights over it (root, or the owner of its user namespace)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    done: list[str] = []
    for path in sorted({os.path.realpath(p) for p in read_paths} | {os.path.realpath(write_dir)}):
        if any(path == d or path.startswith(d.rstrip("/") + "/") for d in done) or not os.path.exists(path):
            continue
        target = new_root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        _mount(path, target, None, MS_BIND | MS_REC)
        if path != os.path.realpath(write_dir):
            _remount_read_only(target)
        done.append(path)
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(38, f"no pivot_root number for {machine}")
    os.chdir(new_root)
    _ok(libc().syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    _ok(libc().umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    _remount_read_only("/")


def read_only_dirs() -> list[str]:
    """The Python installation (stdlib, site-packages) and the system's shared libraries."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    kinds = ("stdlib", "platstdlib", "purelib", "platlib")
    paths |= {v for k, v in sysconfig.get_paths().items() if k in kinds}
    paths |= {"/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc/ld.so.cache", "/dev/null",
              "/dev/urandom", "/usr/share/zoneinfo"}
    return sorted(p for p in paths if p and os.path.exists(p) and os.path.realpath(p) != "/")


# --------------------------------------------------------------------------- capabilities

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Give up every capability (those a user namespace grants its creator included), for good."""
    lc = libc()
    for cap in range(64):
        if lc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0),
                    ctypes.c_ulong(0)) != 0:
            break  # EINVAL past the last capability
    lc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0), ctypes.c_ulong(0),
             ctypes.c_ulong(0))
    data = (_CapData * 2)()
    _ok(lc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data), "capset")


# --------------------------------------------------------------------------- Landlock

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
    fd = _ok(lc.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(size), ctypes.c_uint32(0)),
             "landlock_create_ruleset")
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
                _ok(lc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(fd),
                               ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)),
                    f"landlock_add_rule {path}")
            finally:
                os.close(pfd)
        _ok(lc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)),
            "landlock_restrict_self")
    finally:
        os.close(fd)


def remove_tree(path: str) -> None:
    """``rm -rf`` that also gets through directories a call made unreadable (``chmod 000``)."""
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    for root, dirs, _ in os.walk(path):
        for d in [root, *(os.path.join(root, x) for x in dirs)]:
            try:
                os.chmod(d, 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
