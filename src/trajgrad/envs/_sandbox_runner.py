"""Child side of :class:`trajgrad.envs.sandbox.SandboxedPython` (run as a script).

Started by bubblewrap as ``python -I -B -X utf8 runner.py RESULT_FD`` inside the
sandbox (see :mod:`trajgrad.envs.bubblewrap`), with the request (JSON: code, limits) on
standard input, a pipe the parent writes (no file of the host). In this order it:

1. imports a small set of harmless modules that user code may use (math, cmath,
   fractions, decimal, statistics, random, re, json, itertools, functools,
   collections, heapq, bisect, datetime, string, copy, operator);
2. closes every inherited descriptor but 0, 1, 2 and RESULT_FD, reads the request,
   then points standard input at ``/dev/null``;
3. when asked to (the parent is root and ``drop_privileges=True``), switches to the
   unprivileged user; if that does not fully succeed it exits with code 70 without
   running anything;
4. sets the resource limits (the hard limits cannot be raised again without
   privileges): RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC = 0, RLIMIT_FSIZE,
   RLIMIT_NOFILE, RLIMIT_CORE = 0;
5. writes the ``ready`` frame on RESULT_FD, compiles the code, installs the
   in-process guards (an audit hook and import guards, the second layer; each
   violation is written as a frame on RESULT_FD the moment it happens);
6. runs the code with ``sys.stdout``/``sys.stderr`` on the real descriptors 1 and 2
   (the parent reads them as plain data), then writes a ``result`` frame (the repr of
   a final expression's value, or the exception) and exits.

Frames are JSON lines, each written whole (a violation frame is at most a few KiB: one
atomic pipe write). The user code runs in this process, so it can write frames too:
the parent therefore reads them strictly (anything but this protocol is tampering,
:mod:`trajgrad.envs._sandbox_channel`), takes from them only what the code could have
printed anyway (its last value, its exception, a violation it reports against itself)
and decides everything else (limits, isolation, the kill, tampering, a seccomp kill)
from what it observes. The guards here are advisory: code can switch them off.
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

# Harmless modules imported before the guards, so that user code can use them.
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

FILENAME = "<sandbox>"
EXIT_DROP_FAILED = 70
EXIT_CHANNEL_LOST = 71

# Modules that nothing may load once the guards are on (meta-path finder).
LOAD_BLOCKED = frozenset(
    {
        "os", "posix", "nt", "subprocess", "_posixsubprocess", "socket", "_socket",
        "ssl", "_ssl", "ctypes", "_ctypes", "shutil", "multiprocessing",
        "_multiprocessing", "pty", "fcntl", "mmap",
    }
)
# Modules user code may not import by name (some are already loaded, which a meta-path
# finder never sees).
USER_BLOCKED = LOAD_BLOCKED | frozenset(
    {"signal", "_signal", "resource", "gc", "importlib", "_imp", "_thread", "_io", "_posixshmem"}
)

REFUSED_EVENTS = {
    "os.system": "process creation is not allowed",
    "os.exec": "process creation is not allowed",
    "os.fork": "process creation is not allowed",
    "os.forkpty": "process creation is not allowed",
    "os.posix_spawn": "process creation is not allowed",
    "os.spawn": "process creation is not allowed",
    "subprocess.Popen": "process creation is not allowed",
    "pty.spawn": "process creation is not allowed",
    "os.kill": "sending signals is not allowed",
    "os.killpg": "sending signals is not allowed",
    "os.chdir": "changing directory is not allowed",
    "os.chmod": "changing permissions is not allowed",
    "os.chown": "changing ownership is not allowed",
    "os.symlink": "creating links is not allowed",
    "os.link": "creating links is not allowed",
    "os.setxattr": "changing file attributes is not allowed",
    "os.removexattr": "changing file attributes is not allowed",
    "resource.setrlimit": "changing resource limits is not allowed",
    "resource.prlimit": "changing resource limits is not allowed",
    "sys.addaudithook": "adding audit hooks is not allowed",
    "cpython.PyFile_SetOpenCodeHook": "changing the open-code hook is not allowed",
    "webbrowser.open": "network access is not allowed",
}
REFUSED_PREFIXES = (("socket.", "network access is not allowed"), ("ctypes.", "ctypes is not allowed"))
WRITE_PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.utime": 1, "os.truncate": 1}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
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


def _frame_writer(fd):
    """``send(dict)``: one JSON line on ``fd``; exits at once if the channel was replaced."""
    st = os.fstat(fd)
    identity = (st.st_dev, st.st_ino)
    fstat, write, exit_, dumps = os.fstat, os.write, os._exit, json.dumps

    def send(frame):
        try:
            now = fstat(fd)
            if (now.st_dev, now.st_ino) != identity:
                raise OSError("channel replaced")
            data = (dumps(frame) + "\n").encode("utf-8", "replace")
            while data:
                data = data[write(fd, data):]
        except BaseException:
            exit_(EXIT_CHANNEL_LOST)

    return send


def _drop_privileges(uid, gid):
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError:
        return False
    if (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) != (uid, uid, gid, gid) or os.getgroups():
        return False
    for regain in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.setgroups([0])):
        try:
            regain()
        except OSError:
            continue
        return False  # a capability survived the switch
    return True


def _set_limits(request):
    def limit(which, soft, hard=None):
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass

    cpu = int(request["cpu_s"])
    limit(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at cpu_s, SIGKILL one second later
    limit(resource.RLIMIT_AS, int(request["memory_mb"]) * 1024 * 1024)
    limit(resource.RLIMIT_NPROC, 0)  # no fork, no threads (not enforced for uid 0)
    limit(resource.RLIMIT_FSIZE, int(request["max_file_bytes"]))
    limit(resource.RLIMIT_NOFILE, 64)
    limit(resource.RLIMIT_CORE, 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises OSError instead


def _install_guards(send, work_dir):
    """Audit hook, refusing ``os`` stubs and import guards; returns the guarded ``__import__``.

    Paths are checked only when they are exactly ``str`` or ``bytes`` and by their text
    alone (no file-system call, no user code runs inside the hook): anything else is
    refused, so a path object cannot answer one thing to the check and another to the
    open. The operating-system boundary holds whatever happens here.
    """
    roots = {work_dir, os.path.dirname(os.path.abspath(__file__)), "/dev/null", "/dev/urandom", "/dev/zero"}
    for entry in [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]:
        if entry:
            roots.add(entry)
    read_roots = tuple(sorted(r.rstrip("/") or "/" for r in roots))
    write_roots = (work_dir,)
    refused_events, refused_prefixes = dict(REFUSED_EVENTS), tuple(REFUSED_PREFIXES)
    write_path_events, write_flags = dict(WRITE_PATH_EVENTS), WRITE_FLAGS
    load_blocked, user_blocked = LOAD_BLOCKED, USER_BLOCKED
    str_, bytes_, int_, type_, tuple_ = str, bytes, int, type, tuple
    PermissionError_, ImportError_ = PermissionError, ImportError

    def lexical(path):
        if type_(path) is bytes_:
            path = path.decode("utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = work_dir + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def inside(path, roots):
        real = lexical(path)
        for root in roots:
            if real == root or real.startswith(root + "/"):
                return True
        return False

    def report(message):
        # At most 300 characters (3.6 KB as JSON): one frame is one atomic pipe write.
        send({"kind": "violation", "message": message[:300]})

    def refuse(message):
        report(message)
        raise PermissionError_(f"sandbox: {message}")

    def is_text(obj):
        return type_(obj) is str_ or type_(obj) is bytes_

    def check_write(path):
        if not (is_text(path) and inside(path, write_roots)):
            refuse(f"writing outside the sandbox directory is not allowed ({path!r})")

    def hook(event, args):
        message = refused_events.get(event)
        if message is not None:
            refuse(f"{message} ({event})")
        for prefix, message in refused_prefixes:
            if event.startswith(prefix):
                refuse(f"{message} ({event})")
        if event == "open":
            path, mode, flags = (tuple_(args) + (None, None, None))[:3]
            writing = (type_(mode) is str_ and any(c in mode for c in "wax+")) or (
                type_(flags) is int_ and flags & write_flags
            )
            if type_(path) is int_:
                if writing:
                    refuse("opening a descriptor for writing is not allowed")
                return
            if writing:
                check_write(path)
            elif not (is_text(path) and inside(path, read_roots)):
                refuse(f"reading outside the sandbox directory and the Python installation is not allowed ({path!r})")
        elif event in ("os.listdir", "os.scandir"):
            path = args[0] if args else None
            if path is not None and type_(path) is not int_ and not (is_text(path) and inside(path, read_roots)):
                refuse(f"listing outside the sandbox directory is not allowed ({path!r})")
        elif event in write_path_events:
            for path in tuple_(args)[: write_path_events[event]]:
                if event == "os.truncate" and type_(path) is int_:
                    continue
                check_write(path)

    class BlockImports:
        """Meta-path finder: the blocked modules cannot be loaded by anyone."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] in load_blocked:
                report(f"import of {name!r} is not allowed")
                raise ImportError_(f"sandbox: import of {name!r} is not allowed", name=name)
            return None

    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and type_(name) is str_ and name.partition(".")[0] in user_blocked:
            report(f"import of {name!r} is not allowed")
            raise ImportError_(f"sandbox: import of {name!r} is not allowed", name=name)
        return real_import(name, globals, locals, fromlist, level)

    import posix

    def make_stub(name, message):
        def stub(*args, **kwargs):
            refuse(f"{message} (os.{name})")

        stub.__name__ = name
        return stub

    for message, names in _STUBBED.items():
        for name in names:
            for module in (os, posix):
                if hasattr(module, name):
                    setattr(module, name, make_stub(name, message))
    sys.meta_path.insert(0, BlockImports)
    sys.addaudithook(hook)
    return guarded_import


def main():
    result_fd = int(sys.argv[1])
    # Keep only 0, 1, 2 and the result pipe (bwrap may leave e.g. the seccomp file open).
    os.closerange(3, result_fd)
    os.closerange(result_fd + 1, 1 << 16)
    send = _frame_writer(result_fd)
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if request.get("drop_uid") is not None:
        if not _drop_privileges(int(request["drop_uid"]), int(request["drop_gid"])):
            os._exit(EXIT_DROP_FAILED)
    _set_limits(request)
    code = request["code"]
    work_dir = request["work_dir"]
    cap = int(request["max_output_bytes"])
    memory_mb = int(request["memory_mb"])
    guards = bool(request.get("guards", True))  # off only in tests of the OS layer alone
    send({"kind": "ready"})

    result = {"kind": "result", "value": None, "error": None}
    body = tail = None
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
    del code, request

    out, err = sys.stdout, sys.stderr
    if body is not None:
        user_builtins = dict(builtins.__dict__)
        if guards:
            user_builtins["__import__"] = _install_guards(send, work_dir)
        user_globals = {"__name__": "__main__", "__builtins__": user_builtins}
        del user_builtins
        sys.stdin = sys.__stdin__ = io.StringIO("")
        try:
            exec(body, user_globals)
            if tail is not None:
                value = eval(tail, user_globals)
                if value is not None:
                    result["value"] = repr(value)[: cap + 1]
                del value
        except BaseException as exc:  # noqa: BLE001 - everything is reported to the agent
            result["error"] = _describe(exc, memory_mb)[: max(cap, 1000) + 1]
    for stream in {id(s): s for s in (out, err, sys.stdout, sys.stderr)}.values():
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    send(result)
    os._exit(0)


def _describe(exc, memory_mb):
    if isinstance(exc, MemoryError):
        return f"MemoryError: memory limit exceeded ({memory_mb} MB)"
    if isinstance(exc, SystemExit):
        return f"SystemExit: {exc.code}"
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt"
    line = None
    # Without source lines: reading them would open files (and trip the guards).
    for frame in traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__), lookup_lines=False):
        if frame.filename == FILENAME:
            line = frame.lineno
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if line is None else f"{text} (line {line})"


if __name__ == "__main__":
    main()
