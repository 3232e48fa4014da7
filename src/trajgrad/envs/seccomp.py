"""A default-deny seccomp filter for the Python sandbox (§22).

A classic-BPF program (``struct sock_filter`` records) that bubblewrap loads with
``--seccomp FD`` just before it executes the runner; it then binds the runner and
everything the untrusted code does, and cannot be removed. Every number of the
kernel's system-call table (:mod:`._syscall_tables`) gets exactly one answer:

* **allowed** (:data:`ALLOWED`, by group, with the reason): what the interpreter, the
  C library and the runner need to read the installation, work in the private work
  directory, compute, wait, use threads where the limits allow them, and talk over
  sockets inside the sandbox's empty network namespace. Four calls are allowed only
  with some arguments:

  - ``clone``: only a thread (``CLONE_THREAD``) without any ``CLONE_NEW*`` flag;
    otherwise ``EPERM`` (``fork`` and ``vfork`` are ``EPERM`` too);
  - ``clone3``: ``ENOSYS`` (its flags sit in memory a filter cannot read; the C library
    then falls back to ``clone``);
  - ``socket`` and ``socketpair``: only the families in :data:`SOCKET_FAMILIES`
    (``AF_UNIX``, ``AF_INET``, ``AF_INET6``); any other (``AF_VSOCK``, ``AF_NETLINK``,
    ``AF_PACKET``, ...) gets ``EAFNOSUPPORT``. ``AF_VSOCK`` in particular is not bound
    by the network namespace;
  - ``ioctl``: only the terminal and descriptor requests in :data:`IOCTL_REQUESTS`
    (``isatty``, the window size, non-blocking and close-on-exec flags, bytes
    readable); any other gets ``EPERM``.

* **killed** (:data:`KILLED`): calls that reach other processes' memory or
  descriptors, kernel extension points, namespaces and mounts (``ptrace``,
  ``process_vm_*``, ``pidfd_getfd``, ``kcmp``, ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``io_uring_*``, ``keyctl``, ``mount`` and the new mount API,
  ``unshare``, ``setns``, ``chroot``, ``open_by_handle_at``, module and ``kexec``
  loading, ...). No honest program makes them; the process is killed with ``SIGSYS``,
  which the parent sees in the exit status: a verdict the code cannot hide.
* **refused**: every other call in the table gets ``EPERM``;
* **unknown**: a number the table does not know (a newer kernel's call) gets
  ``ENOSYS``; on x86-64 every call of the x32 ABI gets ``ENOSYS``; a call from another
  architecture's ABI kills the process.

:func:`build_filter` returns ``None`` on machines other than x86-64 and AArch64 (the
sandbox then runs without it and says so in ``last_run["seccomp"]``). The tests
exercise the x86-64 table; the AArch64 one follows the kernel's generic numbering and
the same names.
"""
from __future__ import annotations

import errno
import platform
import struct
from typing import Dict, List, Optional, Tuple

from ._syscall_tables import GENERIC, X86_64

__all__ = ["build_filter", "classify", "ALLOWED", "KILLED", "SOCKET_FAMILIES", "IOCTL_REQUESTS"]

ALLOWED: Dict[str, str] = {
    # The namespaces decide what these can reach: the read-only installation, the tmpfs
    # work directory, /dev's minimal set, pipes and sockets of the sandbox's own.
    "files and descriptors": """
        read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 open openat
        openat2 creat close close_range lseek stat fstat lstat newfstatat statx statfs fstatfs
        access faccessat faccessat2 getdents getdents64 getcwd chdir fchdir rename renameat
        renameat2 mkdir mkdirat rmdir link linkat unlink unlinkat symlink symlinkat readlink
        readlinkat chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat umask truncate
        ftruncate fallocate fsync fdatasync sync_file_range flock fcntl utime utimes futimesat
        utimensat getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr sendfile splice
        tee copy_file_range fadvise64 readahead dup dup2 dup3 pipe pipe2""",
    "waiting for descriptors": """
        select pselect6 poll ppoll epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait
        epoll_pwait2 eventfd eventfd2""",
    # Bounded by RLIMIT_AS.
    # (map_shadow_stack: the C library's shadow stacks for threads where CET is on;
    # mseal: sealing the process's own mappings.)
    "memory": "brk mmap munmap mremap mprotect madvise msync mincore membarrier map_shadow_stack mseal",
    # Signals reach only the sandbox's own PID namespace.
    "threads, signals and clocks": """
        futex futex_waitv futex_wake futex_wait futex_requeue set_tid_address set_robust_list rseq
        arch_prctl sched_yield
        sched_getaffinity getcpu rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending
        rt_sigtimedwait rt_sigsuspend sigaltstack pause kill tgkill tkill nanosleep
        clock_nanosleep clock_gettime clock_getres gettimeofday time times getitimer setitimer
        alarm timerfd_create timerfd_settime timerfd_gettime signalfd signalfd4""",
    # Raising a hard limit needs CAP_SYS_RESOURCE, which the child does not have.
    "the process's own identity and limits": """
        getpid getppid gettid getuid geteuid getgid getegid getgroups getresuid getresgid
        getpgrp getpgid getsid uname sysinfo getrusage getrlimit setrlimit prlimit64
        getpriority sched_getparam sched_getscheduler sched_get_priority_max
        sched_get_priority_min getrandom capget prctl""",
    # The runner switches to ``nobody`` after the filter is loaded; without capabilities
    # these calls can only lower privileges.
    "the privilege drop": "setuid setgid setgroups setresuid setresgid setreuid setregid setfsuid setfsgid",
    # bubblewrap executes the runner under the filter; only the installation is there.
    "start and end": "execve exit exit_group wait4 waitid",
    # The network namespace is empty (its own loopback, down); families: see ``socket``.
    "sockets": """
        connect accept accept4 bind listen shutdown sendto recvfrom sendmsg recvmsg sendmmsg
        recvmmsg getsockname getpeername setsockopt getsockopt""",
}

KILLED = frozenset(
    """
    ptrace process_vm_readv process_vm_writev pidfd_getfd kcmp bpf perf_event_open userfaultfd
    keyctl add_key request_key mount umount2 pivot_root chroot unshare setns open_tree
    open_tree_attr move_mount fsopen fsconfig fsmount fspick mount_setattr io_uring_setup
    io_uring_enter io_uring_register kexec_load kexec_file_load init_module finit_module
    delete_module create_module reboot swapon swapoff acct iopl ioperm modify_ldt quotactl
    quotactl_fd name_to_handle_at open_by_handle_at lookup_dcookie fanotify_init fanotify_mark
    uselib
    """.split()
)

# AF_UNIX, AF_INET, AF_INET6.
SOCKET_FAMILIES: Tuple[int, ...] = (1, 2, 10)
# TCGETS (isatty), TIOCGPGRP, TIOCGWINSZ, FIONREAD, FIONBIO, FIONCLEX, FIOCLEX.
IOCTL_REQUESTS: Tuple[int, ...] = (0x5401, 0x540F, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451)

_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_EPERM, _ENOSYS = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
_EAFNOSUPPORT = _RET_ERRNO | errno.EAFNOSUPPORT
_ARG0, _ARG1 = 16, 24  # low 32 bits of args[0], args[1] in struct seccomp_data (little-endian)

_CLONE_THREAD = 0x00010000
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
# NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

_ARCH = {"x86_64": (0xC000003E, X86_64), "aarch64": (0xC00000B7, GENERIC)}


def _allowed_names() -> frozenset:
    return frozenset(name for group in ALLOWED.values() for name in group.split())


def classify(table: Dict[str, int]) -> Dict[str, str]:
    """Each call in ``table`` -> ``"allow"``, ``"kill"``, ``"eperm"`` or ``"special"``.

    ``"special"`` calls (``clone``, ``clone3``, ``socket``, ``socketpair``, ``ioctl``)
    are decided by their arguments (module docstring).
    """
    allowed = _allowed_names()
    out = {}
    for name in table:
        if name in ("clone", "clone3", "socket", "socketpair", "ioctl"):
            out[name] = "special"
        elif name in KILLED:
            out[name] = "kill"
        elif name in allowed:
            out[name] = "allow"
        else:
            out[name] = "eperm"
    return out


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _one_of(offset: int, values, deny: int) -> List[bytes]:
    """Load the argument at ``offset``; allow it when it is one of ``values``, else ``deny``."""
    n = len(values)
    ops = [_op(_LD_W_ABS, offset)]
    ops += [_op(_JEQ_K, v, n - i, 0) for i, v in enumerate(values)]
    return ops + [_op(_RET_K, deny), _op(_RET_K, _RET_ALLOW)]


def _special(name: str) -> List[bytes]:
    if name == "clone3":
        return [_op(_RET_K, _ENOSYS)]
    if name == "clone":
        return [
            _op(_LD_W_ABS, _ARG0),
            _op(_JSET_K, _CLONE_NEW, 2, 0),
            _op(_JSET_K, _CLONE_THREAD, 0, 1),
            _op(_RET_K, _RET_ALLOW),
            _op(_RET_K, _EPERM),
        ]
    if name in ("socket", "socketpair"):
        return _one_of(_ARG0, SOCKET_FAMILIES, _EAFNOSUPPORT)
    return _one_of(_ARG1, IOCTL_REQUESTS, _EPERM)  # ioctl


def _program(audit_arch: int, table: Dict[str, int], x32: bool) -> bytes:
    ops = [_op(_LD_W_ABS, 4), _op(_JEQ_K, audit_arch, 1, 0), _op(_RET_K, _RET_KILL_PROCESS), _op(_LD_W_ABS, 0)]
    if x32:
        ops += [_op(_JGE_K, 0x40000000, 0, 1), _op(_RET_K, _ENOSYS)]
    kinds = classify(table)
    for name in sorted((n for n, k in kinds.items() if k == "special"), key=table.get):
        handler = _special(name)
        ops += [_op(_JEQ_K, table[name], 0, len(handler))] + handler
    # The rest: consecutive numbers with one answer form a range; a chain of "below the
    # next range's start?" tests returns each range's answer (numbers not in the table,
    # and those above its end, get ENOSYS).
    answer = {"allow": _RET_ALLOW, "kill": _RET_KILL_PROCESS, "eperm": _EPERM, "special": _RET_ALLOW}
    top = max(table.values())
    by_number = {nr: answer[kinds[name]] for name, nr in table.items()}
    ranges: List[Tuple[int, int]] = []  # (first number, answer)
    for nr in range(top + 2):
        action = by_number.get(nr, _ENOSYS)
        if not ranges or ranges[-1][1] != action:
            ranges.append((nr, action))
    for (_, action), (next_start, _) in zip(ranges, ranges[1:]):
        ops += [_op(_JGE_K, next_start, 1, 0), _op(_RET_K, action)]
    ops.append(_op(_RET_K, ranges[-1][1]))
    return b"".join(ops)


def build_filter(machine: Optional[str] = None) -> Optional[bytes]:
    """The compiled filter for ``machine`` (default: this one), or None where unsupported."""
    machine = (machine or platform.machine()).lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if machine not in _ARCH:
        return None
    audit_arch, table = _ARCH[machine]
    return _program(audit_arch, table, x32=machine == "x86_64")
