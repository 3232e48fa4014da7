r"""A Python sandbox for code-executing tools, and a safe arithmetic evaluator (§22).

§22: "Tool authorization, sandbox, and irreversible-action confirmation remain hard
external constraints." A cost constraint in the objective bounds an *expectation*; the
sandbox bounds every single call.

:class:`SandboxedPython` runs each piece of code in a fresh child process
(``python -I -B _sandbox_runner.py``), with these layers, outermost first:

1. **Process and wall time.** The child runs in its own session (process group), in a
   fresh temporary directory that is deleted afterwards, with a minimal environment. The
   parent kills the whole group after ``timeout_s`` seconds of wall time, and also when
   the child floods its pipes beyond a byte cap.
2. **Operating-system limits, set in the child** (soft = hard, so they cannot be raised):
   ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_NPROC = 0`` (no
   fork, no threads), ``RLIMIT_FSIZE`` (``max_file_bytes``), ``RLIMIT_NOFILE = 64``.
   When the parent runs as root (``RLIMIT_NPROC`` is not enforced for root, and root
   ignores file permissions) the child additionally enters an empty network namespace
   and a private mount namespace in which ``/tmp``, ``/var/tmp``, ``/dev/shm`` and
   ``/run/lock`` are read-only (its own temporary directory stays writable), then drops
   to the ``nobody`` user. Each step is best effort; ``last_run`` says which held.
3. **In-process guards** (``sys.addaudithook`` in the child), which turn an attempt
   into a clear message for the agent: network use (``socket.*``: connect, bind,
   getaddrinfo, ...), process creation (``os.system``, ``subprocess.Popen``,
   ``os.fork``, ``os.exec*``, ``os.posix_spawn``, ``os.spawn*``), signals, ``ctypes``,
   changes of permissions/links, writes outside the temporary directory (``open`` in a
   write mode, ``os.remove``/``rename``/``mkdir``/...), and imports of ``os``,
   ``subprocess``, ``socket``, ``ctypes``, ``shutil``, ``multiprocessing`` (and a few
   similar modules) by user code, through a meta-path finder and a guarded
   ``__import__`` installed after the runner's own imports. Functions that touch the
   file system or create processes without an audit event (``os.mkfifo``,
   ``os.mknod``; also the ``fork``/``exec``/``spawn`` family) are replaced in ``os`` by
   stubs that refuse.
   Audit hooks are not a security boundary on their own in CPython (code can reach
   interpreter internals); they make violations visible, and layers 1 and 2 hold.

**Reads.** User code may read files inside its temporary directory and inside the
Python installation (the prefixes and ``sys.path`` entries: needed for imports), plus
``/dev/null``, ``/dev/urandom``, ``/dev/zero``. Every other read (``/etc/passwd``,
``$HOME``) is refused with an error. Nothing outside the temporary directory is
writable.

**Imports.** The runner preloads math, cmath, fractions, decimal, statistics, random,
re, json, itertools, functools, collections, heapq, bisect, datetime, string, copy and
operator before any guard. After the privilege drop the child imports other modules
only if ``nobody`` can read the Python installation; when it is private (for example
under ``/root``) such an import fails with ``ModuleNotFoundError``, which the agent
sees like any other error.

**Results.** :meth:`SandboxedPython.run` never raises for bad or hostile code: every
violation, limit or crash becomes ``ToolResult(output, error)`` with a message the agent
can read. The output is what the code printed, followed by the ``repr`` of the value of
a final expression (as in a REPL), truncated to ``max_output_bytes``; truncation is
reported as an error that keeps the truncated output.

:func:`safe_eval_arithmetic` evaluates arithmetic without any process: it walks the
``ast`` and allows only numbers, ``+ - * / // % **``, parentheses and unary signs.
"""
from __future__ import annotations

import ast
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

from .tools import ToolResult

__all__ = ["SandboxedPython", "safe_eval_arithmetic", "format_number", "count_operations"]

_RUNNER = str(Path(__file__).with_name("_sandbox_runner.py"))
_MARKER = b"\x00TRAJGRAD-SANDBOX-RESULT\x00"
_NOBODY = 65534


def _nobody_ids() -> Optional[tuple]:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return (_NOBODY, _NOBODY)


class SandboxedPython:
    """Run untrusted Python code in a resource-limited child process.

    Args:
      timeout_s: wall-clock limit; the whole process group is killed after it.
      cpu_s: CPU-time limit (``RLIMIT_CPU``), integer seconds >= 1.
      memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
      max_output_bytes: cap on the text returned to the agent.
      max_file_bytes: cap on the size of any file the code writes (``RLIMIT_FSIZE``).
      max_code_chars: longer code is refused without starting a process.
      drop_privileges: when running as root, run the child as ``nobody``, in an empty
        network namespace and with read-only world-writable directories (default True;
        ignored when not root).

    Example::

        >>> SandboxedPython().run("sum(range(10))")
        ToolResult(output='45', error=None)
    """

    def __init__(
        self,
        timeout_s: float = 2.0,
        cpu_s: int = 1,
        memory_mb: int = 256,
        max_output_bytes: int = 10_000,
        *,
        max_file_bytes: int = 1_000_000,
        max_code_chars: int = 100_000,
        drop_privileges: bool = True,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(cpu_s, int) and cpu_s >= 1):
            raise ValueError(f"cpu_s: expected an integer >= 1, got {cpu_s!r}")
        if not (isinstance(memory_mb, int) and memory_mb >= 64):
            raise ValueError(f"memory_mb: expected an integer >= 64 (the interpreter needs it), got {memory_mb!r}")
        if not (isinstance(max_output_bytes, int) and max_output_bytes >= 1):
            raise ValueError(f"max_output_bytes: expected a positive integer, got {max_output_bytes!r}")
        if not (isinstance(max_file_bytes, int) and max_file_bytes >= 0):
            raise ValueError(f"max_file_bytes: expected a non-negative integer, got {max_file_bytes!r}")
        if not (isinstance(max_code_chars, int) and max_code_chars >= 1):
            raise ValueError(f"max_code_chars: expected a positive integer, got {max_code_chars!r}")
        self.timeout_s = float(timeout_s)
        self.cpu_s = cpu_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_file_bytes = max_file_bytes
        self.max_code_chars = max_code_chars
        self.drop_privileges = bool(drop_privileges)
        # Bytes read from the child's pipes before it is killed as a flood.
        self._pipe_cap = 8 * max_output_bytes + (1 << 20)
        # Tests switch this off to check that the OS layers hold on their own.
        self._in_process_guards = True
        self.last_run: dict = {}

    def __call__(self, code: str) -> ToolResult:
        return self.run(code)

    def run(self, code_or_expression: str) -> ToolResult:
        """Run code (statements, or one expression) and report what it printed and returned.

        Returns:
          ``ToolResult(output, error)``. ``output`` is the printed text followed by the
          ``repr`` of a final expression's value (None is not shown); ``error`` is None
          on success, else one line such as ``"ZeroDivisionError: division by zero
          (line 1)"``, ``"sandbox: network access is not allowed (socket.connect)"``,
          ``"CPU time limit exceeded (1 s); ..."`` or ``"wall-time limit exceeded (2 s); ..."``.
          ``self.last_run`` keeps details of the last run (wall time, exit code, ...).
        """
        if not isinstance(code_or_expression, str):
            return ToolResult("", f"code must be text, got {type(code_or_expression).__name__}")
        if len(code_or_expression) > self.max_code_chars:
            return ToolResult("", f"code is too long ({len(code_or_expression)} > {self.max_code_chars} characters)")
        tmpdir = tempfile.mkdtemp(prefix="trajgrad-sandbox-")
        try:
            return self._run_in(tmpdir, code_or_expression)
        finally:
            _remove_tree(tmpdir)

    # -- internals -------------------------------------------------------------------

    def _run_in(self, tmpdir: str, code: str) -> ToolResult:
        request = {
            "code": code,
            "tmpdir": tmpdir,
            "cpu_s": self.cpu_s,
            "memory_mb": self.memory_mb,
            "max_output_bytes": self.max_output_bytes,
            "max_file_bytes": self.max_file_bytes,
            "isolate": self.drop_privileges,
            "guards": self._in_process_guards,
            "drop_uid": None,
            "drop_gid": None,
        }
        if self.drop_privileges and hasattr(os, "geteuid") and os.geteuid() == 0:
            ids = _nobody_ids()
            try:
                os.chown(tmpdir, ids[0], ids[1])
                request["drop_uid"], request["drop_gid"] = ids
            except OSError:
                pass
        # The request travels in a file that only the (still privileged) runner reads and
        # deletes before running any user code.
        request_path = os.path.join(tmpdir, ".request.json")
        fd = os.open(request_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(request, fh)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmpdir, "TMPDIR": tmpdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", _RUNNER, request_path],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=tmpdir,
                env=env,
                close_fds=True,
                start_new_session=True,
            )
        except OSError as exc:
            return ToolResult("", f"sandbox could not start ({exc})")
        out, err, reason = self._communicate(proc, start)
        wall = time.monotonic() - start
        self.last_run = {
            "wall_s": wall,
            "returncode": proc.returncode,
            "killed": reason,
            "stderr": err[-2000:].decode("utf-8", "replace"),
        }
        return self._interpret(proc.returncode, out, err, reason)

    def _communicate(self, proc: subprocess.Popen, start: float):
        """Read both pipes up to a cap until EOF or the wall time; then kill the group.

        The group is killed before the child is reaped, so its id cannot have been reused.
        """
        reason = None
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        chunks = {out_fd: [], err_fd: []}
        sizes = dict.fromkeys(chunks, 0)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        deadline = start + self.timeout_s
        try:
            while sel.get_map() and reason is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    reason = "wall"
                    break
                for key, _ in sel.select(remaining):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    sizes[key.fd] += len(data)
                    if sizes[key.fd] > self._pipe_cap:
                        reason = "flood"
                        break
                    chunks[key.fd].append(data)
            if reason is None and not _exited_unreaped(proc.pid, deadline):
                # Both pipes are closed, yet the child is still running.
                reason = "wall"
        finally:
            sel.close()
            # Kill whatever is left of the group while the leader is not reaped yet (a
            # zombie keeps its process-group id reserved, so no unrelated group is hit).
            _kill_group(proc)
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                stream.close()
        return b"".join(chunks[out_fd]), b"".join(chunks[err_fd]), reason

    def _interpret(self, returncode: Optional[int], out: bytes, err: bytes, reason: Optional[str]) -> ToolResult:
        cap = self.max_output_bytes
        if reason == "wall":
            return ToolResult("", f"wall-time limit exceeded ({self.timeout_s:g} s); the process was killed")
        if reason == "flood":
            return ToolResult("", f"output limit exceeded ({cap} bytes); the process was killed")
        at = out.rfind(_MARKER)
        if at < 0:
            if returncode is not None and returncode < 0:
                sig = -returncode
                if sig == signal.SIGXCPU:
                    return ToolResult("", f"CPU time limit exceeded ({self.cpu_s} s); the process was killed")
                if sig == signal.SIGKILL:
                    return ToolResult(
                        "", f"the process was killed (CPU time {self.cpu_s} s or memory {self.memory_mb} MB limit)"
                    )
                return ToolResult("", f"the process was killed by signal {signal.Signals(sig).name}")
            return ToolResult("", f"the process exited without a result (exit code {returncode})")
        try:
            result = json.loads(out[at + len(_MARKER):].decode("utf-8", "replace"))
        except ValueError:
            return ToolResult("", "the process returned a malformed result")
        self.last_run.update(
            network_isolated=result.get("network_isolated"),
            filesystem_isolated=result.get("filesystem_isolated"),
            dropped_privileges=result.get("dropped_privileges"),
        )
        text = str(result.get("stdout", ""))
        stderr = str(result.get("stderr", ""))
        if stderr:
            text = f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{stderr}"
        value = result.get("value")
        if value is not None:
            text = f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{value}"
        total = int(result.get("stdout_chars", 0)) + int(result.get("stderr_chars", 0))
        output, truncated = _truncate(text, cap)
        truncated = truncated or total > cap or (value is not None and len(value) > cap)
        error = result.get("error")
        if truncated:
            note = f"output truncated to {cap} bytes"
            error = note if error is None else f"{error}; {note}"
        return ToolResult(output, error)


def _truncate(text: str, cap: int):
    data = text.encode("utf-8", "replace")
    if len(data) <= cap:
        return text, False
    return data[:cap].decode("utf-8", "ignore"), True


def _exited_unreaped(pid: int, deadline: float) -> bool:
    """Wait (until ``deadline``) for ``pid`` to exit, leaving it unreaped."""
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except ChildProcessError:
            return True
        if info is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --- safe arithmetic ------------------------------------------------------------------

Number = Union[int, float]
_MAX_EXPR_CHARS = 1000
_MAX_INT_BITS = 4096
_MAX_EXPONENT = 4096

_BINOPS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


def _check_size(value: Number) -> Number:
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            raise ValueError(f"expr: result too large (more than {_MAX_INT_BITS} bits)")
        return value
    if not math.isfinite(value):
        raise ValueError("expr: result is not finite")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, float) or isinstance(base, float):
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"expr: exponent too large (|exponent| > {_MAX_EXPONENT})")
        if base == 0 and exponent < 0:
            raise ValueError("expr: division by zero")
        if base < 0 and not float(exponent).is_integer():
            raise ValueError("expr: fractional power of a negative number")
        try:
            return _check_size(float(base) ** float(exponent))
        except OverflowError:
            raise ValueError("expr: result too large") from None
    if exponent < 0:
        if base == 0:
            raise ValueError("expr: division by zero")
        return _check_size(_exact_div(1, _power(base, -exponent)))
    if abs(base) > 1 and exponent * math.log2(abs(base)) > _MAX_INT_BITS:
        raise ValueError(f"expr: result too large (more than {_MAX_INT_BITS} bits)")
    return base**exponent


def _exact_div(a: Number, b: Number) -> Number:
    if b == 0:
        raise ValueError("expr: division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    try:
        return a / b
    except OverflowError:
        raise ValueError("expr: result too large") from None


def _binop(op: type, a: Number, b: Number) -> Number:
    if op is ast.Add:
        return _check_size(a + b)
    if op is ast.Sub:
        return _check_size(a - b)
    if op is ast.Mult:
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_INT_BITS + 1:
            raise ValueError(f"expr: result too large (more than {_MAX_INT_BITS} bits)")
        return _check_size(a * b)
    if op is ast.Div:
        return _check_size(_exact_div(a, b))
    if op is ast.FloorDiv:
        if b == 0:
            raise ValueError("expr: division by zero")
        return _check_size(a // b)
    if op is ast.Mod:
        if b == 0:
            raise ValueError("expr: division by zero (modulo)")
        return _check_size(a % b)
    if op is ast.Pow:
        return _power(a, b)
    raise ValueError(f"expr: operator {op.__name__} is not allowed")  # pragma: no cover


def _eval_node(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expr: only numbers are allowed, got {value!r}")
        return _check_size(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _binop(type(node.op), _eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.Name):
        raise ValueError(f"expr: names are not allowed ({node.id!r})")
    if isinstance(node, ast.Call):
        raise ValueError("expr: function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise ValueError("expr: attribute access is not allowed")
    if isinstance(node, ast.BinOp):
        raise ValueError(f"expr: operator {type(node.op).__name__} is not allowed")
    raise ValueError(f"expr: {type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")


def _parse(expr: str) -> ast.Expression:
    if not isinstance(expr, str):
        raise ValueError(f"expr: expected a string, got {type(expr).__name__}")
    text = expr.strip()
    if not text:
        raise ValueError("expr: empty expression")
    if len(text) > _MAX_EXPR_CHARS:
        raise ValueError(f"expr: expression too long ({len(text)} > {_MAX_EXPR_CHARS} characters)")
    if "_" in text:  # rules out names and digit separators such as 1_000 alike
        raise ValueError("expr: '_' is not allowed")
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"expr: not a valid arithmetic expression: {text!r}") from None


def safe_eval_arithmetic(expr: str) -> Number:
    """Evaluate an arithmetic expression without ``eval``.

    Allowed: integer and decimal literals, ``+ - * / // % **``, parentheses, unary
    ``-``/``+``. ``/`` is exact on integers when the division is exact (``6 / 3 == 2``,
    an ``int``), else a float. Rejected with ``ValueError`` (message starting with
    ``"expr:"``): names, calls, attribute access, any other syntax, division by zero,
    integers beyond 4096 bits, exponents whose result would exceed that, non-finite
    floats, expressions longer than 1000 characters.
    """
    try:
        return _eval_node(_parse(expr))
    except RecursionError:
        raise ValueError("expr: expression nested too deeply") from None


def count_operations(expr: str) -> int:
    """Number of binary operators in ``expr`` (unary signs are not counted)."""
    tree = _parse(expr)
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))


def format_number(value: Number) -> str:
    """Integers as digits; floats with up to 12 significant digits (``3.5``, ``0.333333333333``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)
