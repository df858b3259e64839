"""The sandbox's seccomp filter: a short deny list in classic BPF, installed in each call's process.

Standard library only (the fork server loads it by path). Why our own filter and not libseccomp:
the Python bindings libseccomp maintains are not on PyPI (Debian's ``python3-seccomp`` serves the
system Python only) and ``pyseccomp`` (a ctypes wrapper of ``libseccomp.so``) was last released in
2021; a filter of about 60 denied system calls is short enough to read here, needs no shared
library a conda or venv Python may lack, and is tested on every run of the test suite
(``tests/test_sandbox_attacks.py``).

What it does, by the kernel's own numbers for x86_64 and aarch64 (tables below, from the kernel's
``unistd_64.h`` and ``asm-generic/unistd.h``; only x86_64 is run here):

- **another architecture** (a 32-bit ``int 0x80`` call, x32's numbers at ``0x40000000``):
  the process is killed (``SIGSYS``);
- **other processes are out of reach**: ``kill``/``tkill``/``tgkill``/``rt_sigqueueinfo``/
  ``rt_tgsigqueueinfo`` only to the process itself (``kill(0)`` its own process group, which
  holds only it), ``prlimit64`` only on itself; ``ptrace``, ``process_vm_readv``/``writev``,
  ``pidfd_open``/``pidfd_send_signal``/``pidfd_getfd``, ``process_madvise``, ``kcmp``,
  ``move_pages``/``migrate_pages``, ``get_robust_list`` are refused;
- **no scheduling of anyone** (itself included): ``setpriority``, ``sched_setaffinity``,
  ``sched_setscheduler``/``setparam``/``setattr``, ``ioprio_set``;
- **no kernel attack surface it has no use for**: ``perf_event_open``, ``bpf``, ``userfaultfd``,
  ``keyctl``/``add_key``/``request_key``, ``io_uring_*``, the mount API, ``unshare``/``setns``,
  ``clone`` with a namespace flag (``clone3``: ``ENOSYS``, so the C library falls back to
  ``clone``), ``execve``/``execveat``, ``setsid``/``setpgid`` (it stays in the process group the
  server kills), ``prctl`` ``PR_SET_PDEATHSIG``/``PR_SET_DUMPABLE``/``PR_SET_PTRACER``, and what
  only root could do (modules, reboot, clock, swap, ...);
- **no sockets** (``socket``; ``socketpair`` stays, for asyncio's self-pipe): no network, and no
  unix socket of the host either (a user's D-Bus or systemd socket, ``docker.sock``), which
  Landlock does not cover.

Installed with ``SECCOMP_FILTER_FLAG_SPEC_ALLOW``: kernels whose Spectre default is ``seccomp``
(before 5.16) would otherwise turn on store-bypass and indirect-branch mitigations for the call's
process, which slow it and protect only its own memory, where there is nothing of anyone else's.

A refused call fails with ``EPERM`` (Python raises ``PermissionError``): the model's code sees an
ordinary error. Argument checks compare the low 32 bits, which is what the kernel reads of an
``int`` argument. Everything else is allowed, so the Python runtime works as usual.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

# name: (x86_64, aarch64); None: no such call on that architecture
NR = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240), "pidfd_open": (434, 434), "pidfd_send_signal": (424, 424),
    "pidfd_getfd": (438, 438), "process_madvise": (440, 440), "process_mrelease": (448, 448),
    "kcmp": (312, 272), "setpriority": (141, 140), "sched_setaffinity": (203, 122),
    "sched_setscheduler": (144, 119), "sched_setparam": (142, 118), "sched_setattr": (314, 274),
    "ioprio_set": (251, 30), "prlimit64": (302, 261), "perf_event_open": (298, 241), "bpf": (321, 280),
    "userfaultfd": (323, 282), "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "unshare": (272, 97), "setns": (308, 268), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "clone": (56, 220), "clone3": (435, 435), "execve": (59, 221),
    "execveat": (322, 281), "setpgid": (109, 154), "setsid": (112, 157), "prctl": (157, 167),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "move_pages": (279, 239), "migrate_pages": (256, 238), "get_robust_list": (274, 100),
    "reboot": (169, 142), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "iopl": (172, None), "ioperm": (173, None), "swapon": (167, 224), "swapoff": (168, 225),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171), "sethostname": (170, 161), "setdomainname": (171, 162), "syslog": (103, 116),
    "acct": (163, 89), "quotactl": (179, 60), "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265), "lookup_dcookie": (212, 18), "vhangup": (153, 58),
    "uselib": (134, None), "fanotify_init": (300, 262), "socket": (41, 198),
}
ARCHES = {"x86_64": (0, 0xC000003E), "amd64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7),
          "arm64": (1, 0xC00000B7)}
DENY = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
        "process_madvise", "process_mrelease", "kcmp", "move_pages", "migrate_pages", "get_robust_list",
        "setpriority", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
        "ioprio_set", "perf_event_open", "bpf", "userfaultfd", "keyctl", "add_key", "request_key", "mount",
        "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen",
        "fsconfig", "fsmount", "fspick", "mount_setattr", "execve", "execveat", "setpgid", "setsid",
        "io_uring_setup", "io_uring_enter", "io_uring_register", "reboot", "kexec_load",
        "kexec_file_load", "init_module", "finit_module", "delete_module", "iopl", "ioperm", "swapon",
        "swapoff", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
        "setdomainname", "syslog", "acct", "quotactl", "name_to_handle_at", "open_by_handle_at",
        "lookup_dcookie", "vhangup", "uselib", "fanotify_init", "socket")
CLONE_NEW_ANY = 0x7E020080  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_PTRACER = 1, 4, 0x59616D61
X32_BIT = 0x40000000

# classic BPF
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
OFF_NR, OFF_ARCH = 0, 4
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1, 1 << 2


def arch() -> tuple[int, int] | None:
    """(column in :data:`NR`, AUDIT_ARCH value) of this machine, or None where there is no table."""
    return ARCHES.get(platform.machine().lower())


def _arg(i: int) -> int:
    return 16 + 8 * i  # low 32 bits of seccomp_data.args[i] (little-endian)


def program(pid: int, machine: tuple[int, int] | None = None) -> list[tuple[int, int, int, int]]:
    """The filter for a process whose own pid (as it sees it) is ``pid``: (code, jt, jf, k) rows."""
    col, audit_arch = machine or arch()
    nr = {k: v[col] for k, v in NR.items() if v[col] is not None}
    deny = RET_ERRNO | errno.EPERM
    out = [(LD_ABS, 0, 0, OFF_ARCH), (JEQ, 1, 0, audit_arch), (RET, 0, 0, RET_KILL_PROCESS),
           (LD_ABS, 0, 0, OFF_NR)]
    if col == 0:  # x32 calls carry x86_64's audit arch: refuse their numbers
        out += [(JGE, 0, 1, X32_BIT), (RET, 0, 0, RET_KILL_PROCESS)]
    for name in DENY:
        if name in nr:
            out += [(JEQ, 0, 1, nr[name]), (RET, 0, 0, deny)]
    out += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, RET_ERRNO | errno.ENOSYS)]

    def on_arg(name: str, arg: int, values: list[int], allow_listed: bool) -> None:
        """``name`` is allowed iff arg ``arg`` is (``allow_listed``) / is not in ``values``."""
        listed, other = (RET_ALLOW, deny) if allow_listed else (deny, RET_ALLOW)
        n = len(values)
        block = [(LD_ABS, 0, 0, _arg(arg))]
        block += [(JEQ, n - i, 0, v & 0xFFFFFFFF) for i, v in enumerate(values)]
        block += [(RET, 0, 0, other), (RET, 0, 0, listed)]
        out.append((JEQ, 0, len(block), nr[name]))
        out.extend(block)

    me = [pid] if pid == 1 else [pid, -pid]  # in its own PID namespace it is pid 1: kill(-1) is "all"
    on_arg("kill", 0, [0, *me], True)
    for name in ("tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        on_arg(name, 0, [pid], True)
    on_arg("prlimit64", 0, [0, pid], True)
    on_arg("prctl", 0, [PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_PTRACER], False)
    out += [(JEQ, 0, 4, nr["clone"]), (LD_ABS, 0, 0, _arg(0)), (JSET, 0, 1, CLONE_NEW_ANY),
            (RET, 0, 0, deny), (RET, 0, 0, RET_ALLOW)]
    out.append((RET, 0, 0, RET_ALLOW))
    assert len(out) < 4096 and all(jt < 256 and jf < 256 for _, jt, jf, _ in out)
    return out


PID_MARK = 0x7FFFFF00  # stands for the process's pid in the template; never a real pid


class Filter:
    """The filter, compiled once in the fork server, with the pid written in per process: building
    it anew in every call's process (a copy-on-write Python) cost about 1 ms."""

    def __init__(self, machine: tuple[int, int] | None = None):
        self.templates = {}
        for own_ns in (True, False):
            rows = program(1 if own_ns else PID_MARK, machine)
            raw = bytearray(b"".join(struct.pack("<HBBI", *r) for r in rows))
            slots = [(i, r[3]) for i, r in enumerate(rows) if r[3] in (PID_MARK, -PID_MARK & 0xFFFFFFFF)]
            self.templates[own_ns] = (raw, slots, ctypes.c_char * len(raw))

    def install(self, libc) -> None:
        """Install the filter in this (single-threaded) process; raises OSError where the kernel
        refuses. Sets ``PR_SET_NO_NEW_PRIVS`` first, which an unprivileged filter needs."""
        pid = os.getpid()
        raw, slots, array = self.templates[pid == 1]
        buf = bytearray(raw)
        for i, k in slots:
            struct.pack_into("<I", buf, 8 * i + 4, pid if k == PID_MARK else -pid & 0xFFFFFFFF)
        mem = array.from_buffer(buf)
        prog = _Prog(len(buf) // 8, ctypes.cast(mem, ctypes.c_void_p))
        if libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"PR_SET_NO_NEW_PRIVS: {os.strerror(e)}")
        nr = {0: 317, 1: 277}[arch()[0]]     # seccomp(2); SPEC_ALLOW: see the module docstring
        if libc.syscall(ctypes.c_long(nr), ctypes.c_long(SECCOMP_SET_MODE_FILTER),
                        ctypes.c_long(SECCOMP_FILTER_FLAG_SPEC_ALLOW), ctypes.byref(prog)) != 0 and \
                libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog),
                           ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"seccomp: {os.strerror(e)}")


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
