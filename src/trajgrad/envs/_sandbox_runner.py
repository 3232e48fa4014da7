"""Child side of :class:`trajgrad.envs.sandbox.SandboxedPython` (run as a script).

Started as ``python -I -B _sandbox_runner.py REQUEST`` with its working directory a
fresh temporary directory. In this order it:

1. imports everything it needs itself, plus a small set of harmless modules that user
   code may use (math, cmath, fractions, decimal, statistics, random, re, json,
   itertools, functools, collections, heapq, bisect, datetime, string, copy, operator);
2. reads the JSON request file (``code``, ``tmpdir``, limits) and deletes it, then
   parses and compiles the code;
3. when started as root: enters an empty network namespace, then drops to the
   unprivileged ``nobody`` user (the parent handed it the temporary directory);
4. sets the resource limits (soft = hard, so they cannot be raised again):
   RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC = 0 (no fork, no threads), RLIMIT_FSIZE,
   RLIMIT_NOFILE, RLIMIT_CORE = 0;
5. installs an audit hook (network, process creation, signals, ctypes, writes outside
   the temporary directory, reads outside it and the Python installation) and the
   import guards (a meta-path finder for modules not yet loaded, a guarded
   ``__import__`` in the user's builtins for the rest);
6. runs the code with stdout/stderr captured in memory (capped) and stdin empty, and
   writes one line ``MARKER + json`` to the real stdout.

The in-process guards make violations visible to the agent; the separate process, the
resource limits, the unprivileged user and the parent's wall-time kill are what hold
if they are bypassed.
"""
import ast
import builtins
import io
import json
import linecache
import os
import resource
import signal
import sys
import traceback

# Harmless modules imported before the guards, so that user code can use them even when
# the Python installation is not readable by the unprivileged user.
import bisect  # noqa: F401
import cmath  # noqa: F401
import collections  # noqa: F401
import copy  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import math  # noqa: F401
import operator  # noqa: F401
import random  # noqa: F401
import re  # noqa: F401
import statistics  # noqa: F401
import string  # noqa: F401

MARKER = "\x00TRAJGRAD-SANDBOX-RESULT\x00"
FILENAME = "<sandbox>"

# Modules that nothing may load once the guards are on (meta-path finder).
LOAD_BLOCKED = frozenset(
    {
        "os", "posix", "nt", "subprocess", "_posixsubprocess", "socket", "_socket",
        "ssl", "_ssl", "ctypes", "_ctypes", "shutil", "multiprocessing",
        "_multiprocessing", "pty", "fcntl", "mmap",
    }
)
# Modules user code may not import by name. Some are already loaded (``os``, ``signal``),
# which a meta-path finder never sees; ``gc`` and ``importlib`` would reach the guards'
# own objects or ``sys.modules`` with less effort.
USER_BLOCKED = LOAD_BLOCKED | frozenset(
    {"signal", "_signal", "resource", "gc", "importlib", "_imp", "_thread", "_io", "_posixshmem"}
)

# Audit events refused outright.
REFUSED_EVENTS = {
    "os.system": "process creation is not allowed",
    "os.exec": "process creation is not allowed",
    "os.fork": "process creation is not allowed",
    "os.forkpty": "process creation is not allowed",
    "os.posix_spawn": "process creation is not allowed",
    "os.spawn": "process creation is not allowed",
    "os.startfile": "process creation is not allowed",
    "subprocess.Popen": "process creation is not allowed",
    "pty.spawn": "process creation is not allowed",
    "os.kill": "sending signals is not allowed",
    "os.killpg": "sending signals is not allowed",
    "os.chdir": "changing directory is not allowed",
    "os.chmod": "changing permissions is not allowed",
    "os.chown": "changing ownership is not allowed",
    "os.symlink": "creating links is not allowed",
    "os.link": "creating links is not allowed",
    "os.chflags": "changing file flags is not allowed",
    "os.lchflags": "changing file flags is not allowed",
    "os.setxattr": "changing file attributes is not allowed",
    "os.removexattr": "changing file attributes is not allowed",
    "resource.setrlimit": "changing resource limits is not allowed",
    "resource.prlimit": "changing resource limits is not allowed",
    "sys.addaudithook": "adding audit hooks is not allowed",
    "cpython.PyFile_SetOpenCodeHook": "changing the open-code hook is not allowed",
    "webbrowser.open": "network access is not allowed",
}
REFUSED_PREFIXES = (
    ("socket.", "network access is not allowed"),
    ("ctypes.", "ctypes is not allowed"),
)
# Events whose path arguments must lie inside the temporary directory.
WRITE_PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.utime": 1}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _Capture(io.TextIOBase):
    """A text stream that keeps at most ``cap`` characters and counts the rest."""

    def __init__(self, cap):
        self.cap = cap
        self.parts = []
        self.kept = 0
        self.total = 0

    def writable(self):
        return True

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        n = len(s)
        self.total += n
        room = self.cap - self.kept
        if room > 0:
            piece = s if n <= room else s[:room]
            self.parts.append(piece)
            self.kept += len(piece)
        return n

    def flush(self):
        pass

    def getvalue(self):
        return "".join(self.parts)


def _isolate(tmpdir):
    """Best effort, as root: empty network namespace; private mounts with the world-writable
    directories read-only (the temporary directory stays writable). Returns (net, fs)."""
    net = fs = False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        newns, newnet = 0x00020000, 0x40000000
        if libc.unshare(newns | newnet) == 0:
            net = True
            ms_rdonly, ms_remount, ms_bind, ms_rec, ms_private = 1, 32, 4096, 16384, 1 << 18

            def mount(source, target, flags):
                src = None if source is None else source.encode()
                return libc.mount(src, target.encode(), None, flags, None) == 0

            fs = mount(None, "/", ms_rec | ms_private) and mount(tmpdir, tmpdir, ms_bind)
            for directory in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
                if fs and os.path.isdir(directory):
                    fs = mount(directory, directory, ms_bind | ms_rec) and mount(
                        None, directory, ms_bind | ms_remount | ms_rdonly
                    )
            os.chdir(tmpdir)  # re-enter through the new mounts
        else:
            net = libc.unshare(newnet) == 0
    except Exception:
        pass
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    return net, fs


# ``os`` functions replaced by refusing stubs before the user code runs: some touch the
# file system without raising an audit event (mkfifo, mknod); the others are audited, and
# replacing them too is one more layer.
_STUBBED = {
    "creating special files is not allowed": ("mkfifo", "mknod"),
    "process creation is not allowed": (
        "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv",
        "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv",
        "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe",
    ),
    "sending signals is not allowed": ("kill", "killpg"),
    "changing the root or namespaces is not allowed": ("chroot", "setns", "unshare"),
    "creating links is not allowed": ("symlink", "link"),
}


def _stub_os(refuse):
    import posix

    def make_stub(name, message):
        def stub(*args, **kwargs):
            refuse(f"{message} (os.{name})")

        stub.__name__ = name
        return stub

    for message, names in _STUBBED.items():
        for name in names:
            stub = make_stub(name, message)
            for module in (os, posix):
                if hasattr(module, name):
                    setattr(module, name, stub)


def _drop_privileges(uid, gid):
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        return True
    except OSError:
        return False


def _set_limits(request):
    def limit(which, soft, hard=None):
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass

    cpu = int(request["cpu_s"])
    limit(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at cpu_s, SIGKILL one second later
    limit(resource.RLIMIT_AS, int(request["memory_mb"]) * 1024 * 1024)
    limit(resource.RLIMIT_NPROC, 0)  # no fork, no threads (not enforced for root)
    limit(resource.RLIMIT_FSIZE, int(request["max_file_bytes"]))
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_CORE, 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises OSError instead


def _install_guards(tmpdir):
    """Install the audit hook and the import guards; return (violations, __import__)."""
    write_roots = (tmpdir,)
    roots = {tmpdir, "/dev/null", "/dev/urandom", "/dev/zero"}
    for entry in [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]:
        if entry:
            roots.add(os.path.realpath(entry))
    read_roots = tuple(sorted(roots))
    # Everything the guards use is bound here, so that rebinding a module-level name from
    # user code (reachable through frames) does not change them.
    refused_events = dict(REFUSED_EVENTS)
    refused_prefixes = tuple(REFUSED_PREFIXES)
    write_path_events = dict(WRITE_PATH_EVENTS)
    write_flags = WRITE_FLAGS
    load_blocked, user_blocked = LOAD_BLOCKED, USER_BLOCKED
    realpath, fsdecode, fspath, sep = os.path.realpath, os.fsdecode, os.fspath, os.sep
    violations = []

    def as_path(obj):
        if isinstance(obj, int):
            return obj
        try:
            return fsdecode(fspath(obj))
        except Exception:
            return None

    def inside(path, roots):
        real = realpath(path)
        return any(real == root or real.startswith(root.rstrip(sep) + sep) for root in roots)

    def refuse(message):
        violations.append(message)
        raise PermissionError(f"sandbox: {message}")

    def check_write(path):
        p = as_path(path)
        if p is None or isinstance(p, int) or not inside(p, write_roots):
            refuse(f"writing outside the sandbox directory is not allowed ({path!r})")

    def hook(event, args):
        message = refused_events.get(event)
        if message is not None:
            refuse(f"{message} ({event})")
        for prefix, message in refused_prefixes:
            if event.startswith(prefix):
                refuse(f"{message} ({event})")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            p = as_path(path)
            if writing:
                check_write(path)
            elif isinstance(p, int):
                pass  # reading an already open descriptor
            elif p is None or not inside(p, read_roots):
                refuse(f"reading outside the sandbox directory and the Python installation is not allowed ({path!r})")
        elif event in ("os.listdir", "os.scandir"):
            p = as_path(args[0]) if args else None
            if isinstance(p, str) and not inside(p, read_roots):
                refuse(f"listing outside the sandbox directory is not allowed ({p!r})")
        elif event in write_path_events:
            for path in tuple(args)[: write_path_events[event]]:
                check_write(path)
        elif event == "os.truncate" and args and not isinstance(args[0], int):
            check_write(args[0])

    class BlockImports:
        """Meta-path finder: the blocked modules cannot be loaded by anyone."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] in load_blocked:
                violations.append(f"import of {name!r} is not allowed")
                raise ImportError(f"sandbox: import of {name!r} is not allowed", name=name)
            return None

    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.partition(".")[0] in user_blocked:
            violations.append(f"import of {name!r} is not allowed")
            raise ImportError(f"sandbox: import of {name!r} is not allowed", name=name)
        return real_import(name, globals, locals, fromlist, level)

    _stub_os(refuse)
    sys.meta_path.insert(0, BlockImports)
    sys.addaudithook(hook)
    return violations, guarded_import


def main():
    with open(sys.argv[1], "rb") as fh:
        request = json.loads(fh.read().decode("utf-8"))
    os.remove(sys.argv[1])
    code = request["code"]
    tmpdir = os.path.realpath(request["tmpdir"])
    cap = int(request["max_output_bytes"])
    memory_mb = int(request["memory_mb"])
    real_stdout = sys.stdout
    result = {
        "value": None,
        "error": None,
        "network_isolated": False,
        "filesystem_isolated": False,
        "dropped_privileges": False,
    }

    # Parse and compile before any guard (needs nothing from outside).
    tail = body = None
    try:
        tree = ast.parse(code, filename=FILENAME, mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, FILENAME, "exec")
        tail = compile(last, FILENAME, "eval") if last is not None else None
    except SyntaxError as exc:
        result["error"] = f"SyntaxError: {exc.msg} (line {exc.lineno})"
    except (ValueError, MemoryError, RecursionError) as exc:
        result["error"] = f"cannot compile the code: {type(exc).__name__}: {exc}"
    linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)

    if os.geteuid() == 0 and request.get("isolate", True):
        result["network_isolated"], result["filesystem_isolated"] = _isolate(tmpdir)
    if os.geteuid() == 0 and request.get("drop_uid") is not None:
        result["dropped_privileges"] = _drop_privileges(int(request["drop_uid"]), int(request["drop_gid"]))
    _set_limits(request)

    stdout = _Capture(cap + 1)
    stderr = _Capture(cap + 1)
    if body is not None:
        user_builtins = dict(builtins.__dict__)
        violations = []
        if request.get("guards", True):  # off only in tests of the OS layers alone
            violations, user_builtins["__import__"] = _install_guards(tmpdir)
        user_globals = {"__name__": "__main__", "__builtins__": user_builtins}
        del user_builtins
        sys.stdout = sys.__stdout__ = stdout
        sys.stderr = sys.__stderr__ = stderr
        sys.stdin = sys.__stdin__ = io.StringIO("")
        try:
            exec(body, user_globals)
            if tail is not None:
                value = eval(tail, user_globals)
                if value is not None:
                    result["value"] = repr(value)[: cap + 1]
                del value
        except BaseException as exc:  # noqa: BLE001 - everything is reported to the agent
            result["error"] = _describe(exc, memory_mb)
        user_globals.clear()
        if violations and (result["error"] is None or "sandbox:" not in result["error"]):
            first = f"sandbox: {violations[0]}"
            result["error"] = first if result["error"] is None else f"{first} (then {result['error']})"

    result["stdout"] = stdout.getvalue()
    result["stderr"] = stderr.getvalue()
    result["stdout_chars"] = stdout.total
    result["stderr_chars"] = stderr.total
    line = MARKER + json.dumps(result) + "\n"
    real_stdout.buffer.write(line.encode("utf-8", "replace"))
    real_stdout.buffer.flush()


def _describe(exc, memory_mb):
    if isinstance(exc, MemoryError):
        return f"MemoryError: memory limit exceeded ({memory_mb} MB)"
    if isinstance(exc, SystemExit):
        return f"SystemExit: {exc.code}"
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt"
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == FILENAME:
            line = frame.lineno
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if line is None else f"{text} (line {line})"


if __name__ == "__main__":
    main()
