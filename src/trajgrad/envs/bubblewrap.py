"""The operating-system boundary of the Python sandbox: a bubblewrap command line (§22).

`bubblewrap <https://github.com/containers/bubblewrap>`_ (``bwrap``, the Debian package
``bubblewrap``) starts a process in new Linux namespaces. :func:`plan` decides, in the
parent, what the child will get; :func:`command` turns that plan into the ``bwrap``
argument list. Nothing here trusts the child: the plan is the parent's own record of the
isolation it set up, and it is the only source of the isolation facts the sandbox
reports.

What the child sees (every mode):

* **Files.** A new, empty root (a tmpfs, then remounted read-only) holding only the
  Python installation (``sys.prefix``, ``sys.base_prefix``, the exec prefixes and the
  interpreter's directory; from a prefix shared with the system such as ``/usr``, only
  the interpreter and Python's own directories), the system's shared-library
  directories the interpreter links against, the runner script, a minimal ``/dev`` (null, zero, full, random,
  urandom, tty; read-only) and a private work directory :data:`WORK_DIR` — a tmpfs of
  at most ``disk_bytes`` bytes in total. Everything but the work directory is
  read-only. No ``/proc``, ``/sys``, ``/etc``, ``/home``, ``/tmp`` of the host, no
  project files.
* **Namespaces.** New mount, PID, network (loopback only, down), IPC, UTS and (where
  the kernel allows) cgroup namespaces. The child cannot see or signal processes
  outside; its namespace dies with it (``--die-with-parent``).
* **Environment.** Empty apart from ``HOME``/``TMPDIR`` (the work directory), ``PATH``
  and ``LANG``. Nothing of the parent's environment.
* **Session.** Its own session (``--new-session``): no access to the parent's terminal.
* **Descriptors.** Pipes only (standard input, output, error, the result channel, the
  seccomp program and ``--info-fd``): no process of the sandbox, bubblewrap's own
  included, holds a descriptor of a host file (see :mod:`trajgrad.envs.sandbox`).

Who the child is, by mode (see :class:`Isolation`):

* ``"nobody"`` — the parent is root and ``drop_privileges=True`` (the default): bwrap
  runs as root to build the namespaces; the runner then switches to the unprivileged
  ``nobody`` user before it reads any user code (it holds exactly ``CAP_SETUID`` and
  ``CAP_SETGID`` until then, none after). ``RLIMIT_NPROC = 0`` then forbids any new
  process or thread. No user namespace is created: an unprivileged user with no
  capabilities needs none, and one would give it capabilities inside it.
* ``"root-in-userns"`` — the parent is root and ``drop_privileges=False``: the child is
  uid 0 inside a new user namespace, with every capability dropped; outside it is still
  uid 0, so ``RLIMIT_NPROC`` is not enforced (the kernel exempts root): the number of
  processes is bounded by the wall time, the seccomp filter (where it is available) and
  the in-process guards only.
* ``"user-in-userns"`` — the parent is an ordinary user: the child runs as the same uid
  inside a new user namespace, no capabilities, ``RLIMIT_NPROC = 0``;
  ``drop_privileges`` has no effect (there is nothing to drop to). Needs unprivileged
  user namespaces (``kernel.unprivileged_userns_clone=1`` where that switch exists).

In the user-namespace modes ``--disable-userns`` stops the child from creating further
user namespaces.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

__all__ = ["Isolation", "WORK_DIR", "RUNNER_PATH", "find_bwrap", "options", "plan", "command", "INSTALL_HINT"]

WORK_DIR = "/sandbox"
RUNNER_PATH = "/.trajgrad-sandbox/runner.py"
INSTALL_HINT = (
    "the Python sandbox needs bubblewrap: install it with `apt-get install -y bubblewrap` "
    "(Debian/Ubuntu), `dnf install bubblewrap` (Fedora) or your distribution's package, "
    "or pass bwrap='/path/to/bwrap'"
)
NOBODY = 65534


@dataclass(frozen=True)
class Isolation:
    """What the parent set up for the child (the parent's record, never the child's word).

    Attributes:
      mode: ``"nobody"``, ``"root-in-userns"`` or ``"user-in-userns"`` (module docstring).
      uid, gid: the child's ids as the kernel sees them outside any user namespace.
      drop_to: ``(uid, gid)`` the runner must switch to before reading the code, or None.
      user_namespace: whether a new user namespace is created.
      namespaces: the namespaces unshared.
      read_only: host paths bound read-only into the child (the Python installation and
        the shared-library directories).
      disk_bytes: size of the private work directory (a tmpfs), the total disk quota.
      process_limit: whether ``RLIMIT_NPROC = 0`` binds the child (not for uid 0).
    """

    mode: str
    uid: int
    gid: int
    drop_to: Optional[Tuple[int, int]]
    user_namespace: bool
    namespaces: Tuple[str, ...]
    read_only: Tuple[str, ...]
    disk_bytes: int
    process_limit: bool
    symlinks: Tuple[Tuple[str, str], ...] = field(default=(), repr=False)

    def as_dict(self) -> dict:
        return {
            "isolation": "bubblewrap",
            "mode": self.mode,
            "uid": self.uid,
            "gid": self.gid,
            "user_namespace": self.user_namespace,
            "namespaces": list(self.namespaces),
            "read_only": list(self.read_only),
            "work_dir": WORK_DIR,
            "disk_bytes": self.disk_bytes,
            "process_limit": self.process_limit,
            "network_isolated": "net" in self.namespaces,
            "filesystem_isolated": True,
            "dropped_privileges": self.drop_to is not None,
        }


def find_bwrap(path: Optional[str] = None) -> str:
    """The ``bwrap`` executable: ``path`` if given, else the one on ``PATH``.

    Raises:
      RuntimeError: bubblewrap is not installed (the message says how to install it), or
        ``path`` is not an executable file.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the Python sandbox needs Linux namespaces; this is {sys.platform}")
    if path is None:
        found = shutil.which("bwrap") or next(
            (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None
        )
        if found is None:
            raise RuntimeError(f"bwrap not found; {INSTALL_HINT}")
        return found
    if not (isinstance(path, str) and os.path.isfile(path) and os.access(path, os.X_OK)):
        raise RuntimeError(f"bwrap: {path!r} is not an executable file; {INSTALL_HINT}")
    return path


_REQUIRED = ("--size", "--perms", "--remount-ro", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop")
_OPTIONAL = ("--disable-userns", "--info-fd", "--seccomp", "--unshare-cgroup-try")


@functools.lru_cache(maxsize=8)
def options(bwrap: str) -> frozenset:
    """The command-line options this ``bwrap`` supports (from its ``--help``).

    Raises:
      RuntimeError: one the sandbox cannot do without is missing (``--size`` is what
        makes the work directory a disk quota).
    """
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"bwrap: {bwrap!r} cannot be run ({exc}); {INSTALL_HINT}") from None
    found = frozenset(o for o in _REQUIRED + _OPTIONAL if o in text.split())
    missing = [o for o in _REQUIRED if o not in found]
    if missing:
        raise RuntimeError(
            f"bwrap: {bwrap!r} does not support {', '.join(missing)}, which the sandbox needs; "
            f"install a newer bubblewrap ({INSTALL_HINT})"
        )
    return found


# Prefixes shared with the rest of the system: from these only Python's own parts are bound.
_SHARED_PREFIXES = ("/", "/usr", "/usr/local")


def _python_paths() -> List[str]:
    """Host paths that make up the running Python installation.

    A prefix of its own (a virtual environment, ``/opt/python3.11``, a pyenv version) is
    bound whole; from a prefix shared with the system (``/usr`` for a distribution's
    Python) only the interpreter, the ``sys.path`` entries and the standard-library and
    site directories inside it.
    """
    prefixes = {os.path.abspath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix) if p}
    prefixes |= {os.path.realpath(p) for p in prefixes}
    shared = [p for p in prefixes if p in _SHARED_PREFIXES]
    paths = [p for p in prefixes if p not in _SHARED_PREFIXES]
    if shared:
        wanted = [e for e in sys.path if e] + [
            v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")
        ]
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):
            libdir, library = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
            if libdir and library:
                wanted.append(os.path.join(libdir, library))
        for entry in wanted:
            real = os.path.realpath(entry)
            if any(real.startswith(p.rstrip(os.sep) + os.sep) for p in shared):
                paths.append(real)
    for e in _symlink_chain(sys.executable) if sys.executable else ():
        inside_shared = any(e.startswith(p.rstrip(os.sep) + os.sep) for p in shared)
        paths.append(e if inside_shared else os.path.dirname(e))
    return _outermost(p for p in paths if os.path.exists(p) and p not in _SHARED_PREFIXES)


def _symlink_chain(path: str) -> List[str]:
    """``path`` and every link it goes through to the real file (all absolute)."""
    chain, seen = [], set()
    current = os.path.abspath(path)
    while current not in seen and len(chain) < 40:
        seen.add(current)
        chain.append(current)
        if not os.path.islink(current):
            break
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    real = os.path.realpath(path)
    return chain if real in chain else chain + [real]


def _library_paths() -> Tuple[List[str], List[Tuple[str, str]]]:
    """Shared-library directories (real paths) and the top-level symlinks to recreate."""
    symlinks = []
    for name in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(name):
            symlinks.append((os.readlink(name), name))
    arch = sysconfig.get_config_var("MULTIARCH")
    candidates = ["/lib64", "/usr/lib64"]
    if arch:
        candidates += [f"/lib/{arch}", f"/usr/lib/{arch}"]
    dirs = [os.path.realpath(c) for c in candidates if os.path.isdir(c)]
    if not arch or not any(d.endswith(arch) for d in dirs):
        dirs += [os.path.realpath(c) for c in ("/lib", "/usr/lib") if os.path.isdir(c)]
    # Binaries under /usr/lib64 may be symlinks into the multiarch directory (Debian).
    return _outermost(dirs), symlinks


def _outermost(paths) -> List[str]:
    """Unique paths with those inside another one dropped, shortest first."""
    out: List[str] = []
    for p in sorted(set(paths), key=lambda q: (q.count(os.sep), q)):
        if p == os.sep or not any(p == o or p.startswith(o.rstrip(os.sep) + os.sep) for o in out):
            out.append(p)
    return out


def plan(drop_privileges: bool, disk_bytes: int) -> Isolation:
    """Decide the isolation for the current parent (root or not) and ``drop_privileges``."""
    uid, gid = os.geteuid(), os.getegid()
    python, (libs, symlinks) = _python_paths(), _library_paths()
    namespaces = ("mount", "pid", "net", "ipc", "uts", "cgroup")
    read_only = tuple(_outermost(python + libs))
    for path in read_only:
        if path == os.sep:
            raise RuntimeError("the Python installation is at '/': binding it would expose the whole host")
        for special in (WORK_DIR, os.path.dirname(RUNNER_PATH), "/dev"):
            if path == special or path.startswith(special + os.sep) or special.startswith(path + os.sep):
                raise RuntimeError(f"the Python installation path {path!r} collides with the sandbox's {special!r}")
    if uid == 0 and drop_privileges:
        nobody = _nobody_ids()
        return Isolation("nobody", nobody[0], nobody[1], nobody, False, namespaces, read_only,
                         disk_bytes, True, tuple(symlinks))
    mode = "root-in-userns" if uid == 0 else "user-in-userns"
    return Isolation(mode, uid, gid, None, True, ("user",) + namespaces, read_only, disk_bytes,
                     uid != 0, tuple(symlinks))


def _nobody_ids() -> Tuple[int, int]:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return NOBODY, NOBODY


def _ancestors(paths) -> List[str]:
    """Every proper ancestor directory of ``paths`` (not inside any of them), shallowest first."""
    found = set()
    for p in paths:
        parent = os.path.dirname(p)
        while parent and parent != os.sep:
            found.add(parent)
            parent = os.path.dirname(parent)
    inside = [a for a in found if any(a == p or a.startswith(p.rstrip(os.sep) + os.sep) for p in paths)]
    return sorted(found - set(inside), key=lambda q: (q.count(os.sep), q))


def command(
    bwrap: str,
    isolation: Isolation,
    runner: str,
    python: str,
    python_args: List[str],
    *,
    seccomp_fd: Optional[int] = None,
    info_fd: Optional[int] = None,
    supported: frozenset = frozenset(_OPTIONAL),
) -> List[str]:
    """The ``bwrap`` argument list that runs ``python python_args`` under ``isolation``.

    ``runner`` (a host path) is bound read-only at :data:`RUNNER_PATH`; ``seccomp_fd`` (an
    inherited descriptor holding a compiled BPF program) is loaded before the exec;
    bubblewrap writes ``{"child-pid": N}`` (the sandbox's first process, seen from the
    host) to ``info_fd``. Optional options not in ``supported`` (see :func:`options`) are
    left out: ``--disable-userns`` (the seccomp filter refuses new user namespaces too)
    and ``--unshare-cgroup-try``.
    """
    argv = [bwrap]
    if isolation.user_namespace:
        argv += ["--unshare-user", "--uid", str(isolation.uid), "--gid", str(isolation.gid)]
        if "--disable-userns" in supported:
            argv += ["--disable-userns"]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    if "--unshare-cgroup-try" in supported:
        argv += ["--unshare-cgroup-try"]
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
    for key, value in (("HOME", WORK_DIR), ("TMPDIR", WORK_DIR), ("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8")):
        argv += ["--setenv", key, value]
    if isolation.drop_to is not None:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--cap-drop", "ALL"]
    mounts = list(isolation.read_only) + [os.path.dirname(RUNNER_PATH), WORK_DIR]
    symlinked = {link for _, link in isolation.symlinks}
    for directory in _ancestors(mounts):
        if directory not in symlinked:
            # World-traversable, whatever the host's mode (e.g. /root is 0700): the
            # unprivileged child must reach the installation bound below it.
            argv += ["--perms", "0755", "--dir", directory]
    for target, link in isolation.symlinks:
        argv += ["--symlink", target, link]
    for path in isolation.read_only:
        argv += ["--ro-bind", path, path]
    argv += ["--ro-bind", runner, RUNNER_PATH]
    argv += ["--dev", "/dev"]
    argv += ["--perms", "0777" if isolation.drop_to is not None else "0755"]
    argv += ["--size", str(isolation.disk_bytes), "--tmpfs", WORK_DIR, "--chdir", WORK_DIR]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return argv + ["--", python] + list(python_args)
