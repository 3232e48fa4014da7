"""A seccomp filter for the Python sandbox: no new processes, no namespace or mount calls (§22).

A classic-BPF program (``struct sock_filter`` records) that bubblewrap loads with
``--seccomp FD`` just before it executes the runner; it then binds the runner and
everything the untrusted code does, and cannot be removed. It answers:

* ``fork``, ``vfork``, and ``clone`` without ``CLONE_THREAD`` or with any
  ``CLONE_NEW*`` namespace flag: ``EPERM`` (threads are still possible; in the modes
  where ``RLIMIT_NPROC = 0`` binds, the kernel refuses those too);
* ``clone3``: ``ENOSYS`` (its flags sit in memory a filter cannot read; the C library
  then falls back to ``clone``);
* namespace, mount and kernel-administration calls (``unshare``, ``setns``, ``mount``
  and the new mount API, ``pivot_root``, ``chroot``, ``ptrace``, ``bpf``,
  ``perf_event_open``, ``keyctl``, ``userfaultfd``, ``io_uring_*``, module and
  ``kexec`` loading, ``reboot``, ``swapon``, ``process_vm_*``, ...): ``EPERM``;
* on x86-64, every call of the x32 ABI: ``ENOSYS``;
* a call from another architecture's ABI: the process is killed.

Everything else is allowed: the namespaces and limits are the main boundary, this filter
only narrows the kernel interface behind it. :func:`build_filter` returns ``None`` on
machines other than x86-64 and AArch64 (the sandbox then runs without it and says so
in ``last_run["seccomp"]``). The tests exercise the x86-64 table; the AArch64 one
follows the kernel's generic system-call numbering.
"""
from __future__ import annotations

import errno
import platform
import struct
from typing import Dict, Optional

__all__ = ["build_filter"]

_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000

_CLONE_THREAD = 0x00010000
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
# NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

_ARCH = {
    "x86_64": (
        0xC000003E,
        {"clone": 56, "clone3": 435},
        {
            "fork": 57, "vfork": 58, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
            "pivot_root": 155, "chroot": 161, "ptrace": 101, "bpf": 321, "perf_event_open": 298,
            "keyctl": 250, "add_key": 248, "request_key": 249, "userfaultfd": 323, "kexec_load": 246,
            "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
            "reboot": 169, "swapon": 167, "swapoff": 168, "process_vm_readv": 310,
            "process_vm_writev": 311, "open_tree": 428, "move_mount": 429, "fsopen": 430,
            "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "acct": 163,
            "iopl": 172, "ioperm": 173, "quotactl": 179,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {"clone": 220, "clone3": 435},
        {
            "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
            "ptrace": 117, "bpf": 280, "perf_event_open": 241, "keyctl": 219, "add_key": 217,
            "request_key": 218, "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294,
            "init_module": 105, "finit_module": 273, "delete_module": 106, "reboot": 142,
            "swapon": 224, "swapoff": 225, "process_vm_readv": 270, "process_vm_writev": 271,
            "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
            "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426,
            "io_uring_register": 427, "acct": 89, "quotactl": 60,
        },
    ),
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _program(audit_arch: int, special: Dict[str, int], denied: Dict[str, int], x32: bool) -> bytes:
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    ops = [_op(_LD_W_ABS, 4), _op(_JEQ_K, audit_arch, 1, 0), _op(_RET_K, _RET_KILL_PROCESS), _op(_LD_W_ABS, 0)]
    if x32:
        ops += [_op(_JGE_K, 0x40000000, 0, 1), _op(_RET_K, enosys)]
    for nr in sorted(denied.values()):
        ops += [_op(_JEQ_K, nr, 0, 1), _op(_RET_K, eperm)]
    ops += [_op(_JEQ_K, special["clone3"], 0, 1), _op(_RET_K, enosys)]
    # clone: allowed only as a thread without namespace flags (flags are args[0]; their low
    # 32 bits sit at offset 16 of struct seccomp_data on these little-endian machines).
    ops += [_op(_JEQ_K, special["clone"], 1, 0), _op(_RET_K, _RET_ALLOW)]
    ops += [
        _op(_LD_W_ABS, 16),
        _op(_JSET_K, _CLONE_NEW, 2, 0),
        _op(_JSET_K, _CLONE_THREAD, 0, 1),
        _op(_RET_K, _RET_ALLOW),
        _op(_RET_K, eperm),
    ]
    return b"".join(ops)


def build_filter(machine: Optional[str] = None) -> Optional[bytes]:
    """The compiled filter for ``machine`` (default: this one), or None where unsupported."""
    machine = (machine or platform.machine()).lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if machine not in _ARCH:
        return None
    audit_arch, special, denied = _ARCH[machine]
    return _program(audit_arch, special, denied, x32=machine == "x86_64")
