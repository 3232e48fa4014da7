r"""A Python sandbox for code-executing tools, bounded by the operating system (§22).

§22: "Tool authorization, sandbox, and irreversible-action confirmation remain hard
external constraints." A cost constraint in the objective bounds an *expectation*; the
sandbox bounds every single call.

:class:`SandboxedPython` runs each piece of code in a fresh process started by
bubblewrap (``bwrap``), with these layers, outermost first (threat model and limits of
each: ``docs/sandbox.md``):

1. **Namespaces** (:mod:`.bubblewrap`): new mount, PID, network, IPC, UTS (and cgroup)
   namespaces, and a user namespace or the unprivileged ``nobody`` user; an empty root
   holding only the Python installation and its shared libraries, read-only; a private
   work directory that is a tmpfs of ``max_disk_bytes`` bytes in total; an empty
   environment; no ``/proc``, no host files, no other processes, no network.
2. **A seccomp filter** (:mod:`.seccomp`, x86-64 and AArch64), default-deny over the
   kernel's whole system-call table: no ``fork``, no socket family but ``AF_UNIX``,
   ``AF_INET`` and ``AF_INET6``; calls that reach other processes, namespaces, mounts
   or kernel extension points (``ptrace``, ``pidfd_getfd``, ``bpf``, ``mount``, ...)
   kill the process, which the parent sees.
3. **Resource limits** set before any user code (hard = soft, so they cannot be
   raised): ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_AS`` (``memory_mb``),
   ``RLIMIT_NPROC = 0``, ``RLIMIT_FSIZE`` (``max_file_bytes`` per file),
   ``RLIMIT_NOFILE``; the parent kills the whole sandbox after ``timeout_s`` seconds
   of wall time or when it writes more than a fixed multiple of ``max_output_bytes``.
4. **In-process guards** (an audit hook and import guards in the child), which turn
   most attempts into one clear message for the agent (``"sandbox: network access is
   not allowed (socket.connect)"``). They are not a boundary: layers 1-3 hold when
   code gets around them, and the violations they report are advisory.

**What the parent trusts.** Nothing the child says about itself beyond what its code
could have printed. The child's standard output and error are read as plain data; its
result frames (the last value, the exception, violations reported against itself, on a
separate pipe) are parsed strictly (:mod:`._sandbox_channel`): anything but the
runner's protocol is tampering, a violation the parent establishes itself, as is a
process the seccomp filter killed (``SIGSYS``). The request reaches the child through a
pipe: no process of the sandbox holds a descriptor of a host file. Limits and kills are
decided by the parent from its own clock, its byte counts and the exit status; the
isolation facts in :attr:`SandboxedPython.last_run` are the parent's record of the
command line it ran (:class:`~trajgrad.envs.bubblewrap.Isolation`).

**Results.** :meth:`SandboxedPython.run` never raises for bad or hostile code: every
violation, limit or crash becomes ``ToolResult(output, error)`` with a message the agent
can read. The output is what the code printed (standard output, then standard error),
followed by the ``repr`` of the value of a final expression (as in a REPL), truncated to
``max_output_bytes``; truncation is reported as an error that keeps the truncated output.

Without bubblewrap the constructor raises ``RuntimeError`` saying how to install it;
nothing ever runs unisolated. The arithmetic helpers formerly defined here live in
:mod:`.arithmetic` and are re-exported.
"""
from __future__ import annotations

import json
import math
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from . import bubblewrap
from .arithmetic import count_operations, format_number, safe_eval_arithmetic
from ._sandbox_channel import UNFINISHED, read_channel
from .seccomp import build_filter
from .tool_result import ToolResult

__all__ = ["SandboxedPython", "safe_eval_arithmetic", "format_number", "count_operations"]

_RUNNER = str(Path(__file__).with_name("_sandbox_runner.py"))
_EXIT_DROP_FAILED = 70  # kept in step with _sandbox_runner.EXIT_DROP_FAILED
_EXIT_CHANNEL_LOST = 71  # ... and EXIT_CHANNEL_LOST
_STARTED: set = set()  # configurations known to start (see SandboxedPython._check_starts)


class SandboxedPython:
    """Run untrusted Python code in a namespace sandbox with resource limits.

    Args:
      timeout_s: wall-clock limit; the whole sandbox is killed after it.
      cpu_s: CPU-time limit (``RLIMIT_CPU``), integer seconds >= 1.
      memory_mb: address-space limit (``RLIMIT_AS``) in MiB, >= 64.
      max_output_bytes: cap on the text returned to the agent.
      max_file_bytes: cap on the size of any one file the code writes (``RLIMIT_FSIZE``).
      max_disk_bytes: total size of the private work directory (a tmpfs), >= 64 KiB.
      max_code_chars: longer code is refused without starting a process.
      drop_privileges: when the parent is root, run the code as ``nobody`` (default);
        ``False`` runs it as uid 0 inside a user namespace without capabilities. No
        effect for an ordinary user (the code runs as that user in a user namespace).
      bwrap: path of the ``bwrap`` executable (default: found on ``PATH``).
      seccomp: load the seccomp filter where it is available (default True).

    Raises:
      ValueError: a limit is out of range (the message names it).
      RuntimeError: bubblewrap is not installed, not executable, or cannot start the
        sandbox on this machine (checked once per configuration and process).

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
        max_disk_bytes: int = 8_000_000,
        max_code_chars: int = 100_000,
        drop_privileges: bool = True,
        bwrap: Optional[str] = None,
        seccomp: bool = True,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(cpu_s, int) and not isinstance(cpu_s, bool) and cpu_s >= 1):
            raise ValueError(f"cpu_s: expected an integer >= 1, got {cpu_s!r}")
        if not (isinstance(memory_mb, int) and not isinstance(memory_mb, bool) and memory_mb >= 64):
            raise ValueError(f"memory_mb: expected an integer >= 64 (the interpreter needs it), got {memory_mb!r}")
        if not (isinstance(max_output_bytes, int) and max_output_bytes >= 1):
            raise ValueError(f"max_output_bytes: expected a positive integer, got {max_output_bytes!r}")
        if not (isinstance(max_file_bytes, int) and max_file_bytes >= 0):
            raise ValueError(f"max_file_bytes: expected a non-negative integer, got {max_file_bytes!r}")
        if not (isinstance(max_disk_bytes, int) and max_disk_bytes >= 65536):
            raise ValueError(f"max_disk_bytes: expected an integer >= 65536, got {max_disk_bytes!r}")
        if not (isinstance(max_code_chars, int) and max_code_chars >= 1):
            raise ValueError(f"max_code_chars: expected a positive integer, got {max_code_chars!r}")
        self.timeout_s = float(timeout_s)
        self.cpu_s = cpu_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.max_file_bytes = max_file_bytes
        self.max_disk_bytes = max_disk_bytes
        self.max_code_chars = max_code_chars
        self.drop_privileges = bool(drop_privileges)
        self.bwrap = bubblewrap.find_bwrap(bwrap)
        self._bwrap_options = bubblewrap.options(self.bwrap)
        self._seccomp = build_filter() if seccomp and "--seccomp" in self._bwrap_options else None
        # Bytes read from the child's pipes before it is killed as a flood.
        self._pipe_cap = 8 * max_output_bytes + (1 << 20)
        # Tests switch this off to check that the OS layers hold on their own.
        self._in_process_guards = True
        self.last_run: dict = {}
        self._check_starts()

    def __call__(self, code: str) -> ToolResult:
        return self.run(code)

    def _check_starts(self) -> None:
        """Start the sandbox once per configuration and process; raise if it cannot start.

        bubblewrap may be installed yet unable to create namespaces (unprivileged user
        namespaces disabled, a restrictive security profile); that is a property of the
        machine, so it fails here, loudly, not as a tool error on every call.
        """
        key = (self.bwrap, os.geteuid(), self.drop_privileges, sys.executable, self._seccomp is not None)
        if key in _STARTED:
            return
        saved = self.timeout_s
        self.timeout_s = max(saved, 30.0)
        try:
            result = self.run("pass")
        finally:
            self.timeout_s = saved
        if not self.last_run.get("ready"):
            raise RuntimeError(
                f"the Python sandbox could not start with {self.bwrap} ({result.error}); "
                "check that bubblewrap can create namespaces here (unprivileged user namespaces "
                "must be enabled for an ordinary user)"
            )
        _STARTED.add(key)

    @property
    def isolation(self) -> bubblewrap.Isolation:
        """What the next run will get (the parent's plan; see :mod:`.bubblewrap`)."""
        return bubblewrap.plan(self.drop_privileges, self.max_disk_bytes)

    def run(self, code_or_expression: str) -> ToolResult:
        """Run code (statements, or one expression) and report what it printed and returned.

        Returns:
          ``ToolResult(output, error)``. ``output`` is the printed text followed by the
          ``repr`` of a final expression's value (None is not shown); ``error`` is None
          on success, else one line such as ``"ZeroDivisionError: division by zero
          (line 1)"``, ``"sandbox: network access is not allowed (socket.connect)"``,
          ``"CPU time limit exceeded (1 s); ..."`` or ``"wall-time limit exceeded (2 s); ..."``.
          ``self.last_run`` keeps details of the last run: wall time, exit
          status, the isolation the parent set up, the violations the child reported.
        """
        if not isinstance(code_or_expression, str):
            return ToolResult("", f"code must be text, got {type(code_or_expression).__name__}")
        if len(code_or_expression) > self.max_code_chars:
            return ToolResult("", f"code is too long ({len(code_or_expression)} > {self.max_code_chars} characters)")
        isolation = self.isolation
        request = {
            "code": code_or_expression,
            "work_dir": bubblewrap.WORK_DIR,
            "cpu_s": self.cpu_s,
            "memory_mb": self.memory_mb,
            "max_output_bytes": self.max_output_bytes,
            "max_file_bytes": self.max_file_bytes,
            "guards": self._in_process_guards,
            "drop_uid": None if isolation.drop_to is None else isolation.drop_to[0],
            "drop_gid": None if isolation.drop_to is None else isolation.drop_to[1],
        }
        # The request and the filter travel through pipes: nothing the child could reach
        # (its init's descriptors included) is a file of the host.
        return self._run(isolation, json.dumps(request).encode("utf-8", "surrogatepass"), self._seccomp)

    # -- internals -------------------------------------------------------------------

    def _run(self, isolation: bubblewrap.Isolation, request: bytes, program: Optional[bytes]) -> ToolResult:
        read_end, write_end = os.pipe()
        info_read, info_write = os.pipe()
        stdin_read, stdin_write = os.pipe()
        seccomp_fd = None
        if program is not None:
            seccomp_fd, filter_write = os.pipe()
            os.write(filter_write, program)  # well below a pipe's buffer (64 KiB): never blocks
            os.close(filter_write)
        argv = bubblewrap.command(
            self.bwrap,
            isolation,
            _RUNNER,
            sys.executable,
            ["-I", "-B", "-X", "utf8", bubblewrap.RUNNER_PATH, str(write_end)],
            seccomp_fd=seccomp_fd,
            info_fd=info_write if "--info-fd" in self._bwrap_options else None,
            supported=self._bwrap_options,
        )
        passed = (write_end, info_write) + (() if seccomp_fd is None else (seccomp_fd,))
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=stdin_read,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                close_fds=True,
                pass_fds=passed,
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (read_end, write_end, info_read, info_write, stdin_read, stdin_write) + passed[2:]:
                os.close(fd)
            return ToolResult("", f"sandbox could not start ({exc})")
        for fd in (write_end, info_write, stdin_read) + passed[2:]:
            os.close(fd)
        os.set_blocking(stdin_write, False)
        channel = os.fdopen(read_end, "rb", buffering=0)
        info = os.fdopen(info_read, "rb", buffering=0)
        out, err, frames, totals, reason, status, child = self._communicate(
            proc, channel, info, start, stdin_write, request
        )
        record = {
            # The host's numbers of bwrap and of the sandbox's first process (None if unknown).
            "pids": {"bwrap": proc.pid, "sandbox": child},
            "wall_s": time.monotonic() - start,
            "returncode": proc.returncode,
            "killed": reason,
            "stderr": err[-2000:].decode("utf-8", "replace"),
            "seccomp": program is not None,
            **isolation.as_dict(),
        }
        result = self._interpret(status, out, err, frames, totals, reason, record)
        self.last_run = record  # one assignment: concurrent runs never mix their records
        return result

    def _communicate(self, proc: subprocess.Popen, channel, info, start: float, stdin_fd: int, request: bytes):
        """Write the request to the child's standard input (then close it); read the pipes
        (capped) until EOF or the wall time; stop the sandbox; reap it.

        Returns (stdout head, stderr head, channel bytes, total stdout+stderr bytes,
        kill reason, wait status, the sandbox's first process id or None).
        """
        reason = None
        keep = self.max_output_bytes + 1
        streams = {
            proc.stdout.fileno(): "out", proc.stderr.fileno(): "err", channel.fileno(): "chan", info.fileno(): "info"
        }
        limits = {"out": keep, "err": keep, "chan": self._pipe_cap, "info": 4096}
        heads = {name: bytearray() for name in limits}
        sizes = dict.fromkeys(limits, 0)
        sel = selectors.DefaultSelector()
        for stream in (proc.stdout, proc.stderr, channel, info):
            sel.register(stream, selectors.EVENT_READ)
        pending = memoryview(request)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
        deadline = start + self.timeout_s
        status = None
        sandbox_pid = None
        try:
            while sel.get_map() and reason is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    reason = "wall"
                    break
                for key, _ in sel.select(remaining):
                    if key.fd == stdin_fd:
                        try:
                            pending = pending[os.write(stdin_fd, pending[:65536]):]
                        except BlockingIOError:
                            continue
                        except OSError:  # the child is gone before reading it all
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(stdin_fd)
                            os.close(stdin_fd)
                            stdin_fd = -1
                        continue
                    data = os.read(key.fd, 65536)
                    name = streams[key.fd]
                    if not data:
                        sel.unregister(key.fileobj)
                        if name == "info":
                            sandbox_pid = _open_sandbox_pid(bytes(heads["info"]), proc.pid)
                        continue
                    sizes[name] += len(data)
                    if len(heads[name]) < limits[name]:
                        heads[name] += data[: limits[name] - len(heads[name])]
                    if sizes["out"] + sizes["err"] > self._pipe_cap or sizes["chan"] > self._pipe_cap:
                        reason = "flood"
                        break
            if reason is None and not _exited_unreaped(proc.pid, deadline):
                reason = "wall"  # all pipes closed, yet the sandbox is still running
        finally:
            sel.close()
            if stdin_fd >= 0:
                os.close(stdin_fd)
            if sandbox_pid is None and reason is not None:
                # bwrap writes the child's pid right after creating it: without it, killing
                # bwrap would orphan that process to the host's init (a zombie where init
                # does not reap), so what is still in the pipe is read first (bounded).
                _drain_info(info, heads["info"], limits["info"], time.monotonic() + _INFO_WAIT_S)
                if heads["info"]:
                    sandbox_pid = _open_sandbox_pid(bytes(heads["info"]), proc.pid)
            child = _child_pid(bytes(heads["info"]))
            status = _stop(proc, sandbox_pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if sandbox_pid is not None:
                os.close(sandbox_pid)
            for stream in (proc.stdout, proc.stderr, channel, info):
                stream.close()
        total = sizes["out"] + sizes["err"]
        return bytes(heads["out"]), bytes(heads["err"]), bytes(heads["chan"]), total, reason, status, child

    def _interpret(self, status, out: bytes, err: bytes, chan: bytes, total: int, reason, record: dict) -> ToolResult:
        cap = self.max_output_bytes
        channel = read_channel(chan)
        ready = channel.ready
        record["ready"] = ready
        # Established by the parent itself: a tampered channel, a system call the filter
        # killed. Reported by the runner's guards (advisory; docs/sandbox.md): violations.
        caught = []
        code = os.waitstatus_to_exitcode(status)
        signum = code - 128 if code > 128 else (-code if code < 0 else 0)
        # A kill (the parent's, or a limit's signal) may cut the frame being written: an
        # unfinished last frame is tampering only when the process ended by itself (a
        # violation frame ends its line, so none can hide in an unfinished last one).
        if channel.tampered is not None and not (channel.tampered == UNFINISHED and (reason or signum)):
            caught.append(f"the result channel was tampered with ({channel.tampered})")
        if ready and reason is None and signum == signal.SIGSYS:
            caught.append("a forbidden system call was made; the process was killed (SIGSYS)")
        violations = caught + [v[:1000] for v in channel.violations]
        record["violations"] = violations[:20]
        record["parent_verdict"] = caught
        text = _join(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
        if reason == "wall":
            message = f"wall-time limit exceeded ({self.timeout_s:g} s); the process was killed"
            return ToolResult(_truncate(text, cap)[0], message)
        if reason == "flood":
            return ToolResult(_truncate(text, cap)[0], f"output limit exceeded ({cap} bytes); the process was killed")
        if not ready:
            if code == _EXIT_DROP_FAILED:
                return ToolResult("", "sandbox: could not switch to the unprivileged user; nothing was run")
            message = err.decode("utf-8", "replace").strip().splitlines()
            detail = message[-1][:300] if message else f"exit code {code}"
            return ToolResult("", f"sandbox could not start ({detail})")
        error: Optional[str] = None
        value: Optional[str] = None
        result = channel.result if channel.tampered is None else None
        if code == _EXIT_CHANNEL_LOST:
            error = "sandbox: the result channel was tampered with; the process was stopped"
        elif signum == signal.SIGXCPU:
            error = f"CPU time limit exceeded ({self.cpu_s} s); the process was killed"
        elif signum == signal.SIGKILL:
            error = f"the process was killed (CPU time {self.cpu_s} s or memory {self.memory_mb} MB limit)"
        elif signum and signum in signal.valid_signals() and signum != signal.SIGSYS:
            error = f"the process was killed by signal {signal.Signals(signum).name}"
        elif result is None:
            if channel.tampered is None and signum != signal.SIGSYS:
                error = f"the process exited without a result (exit code {code})"
        else:
            value, error = result["value"], result["error"]
            if code != 0 and error is None:
                error = f"the process exited with code {code}"
        if violations and (error is None or "sandbox:" not in error):
            first = f"sandbox: {violations[0]}"
            error = first if error is None else f"{first} (then {error})"
        if error is not None and len(error) > max(cap, 1000):
            error = error[: max(cap, 1000)] + " [...]"
        if value is not None:
            text = _join(text, value)
        output, truncated = _truncate(text, cap)
        if truncated or total > cap or (value is not None and len(value) > cap):
            note = f"output truncated to {cap} bytes"
            error = note if error is None else f"{error}; {note}"
        return ToolResult(output, error)


def _join(text: str, more: str) -> str:
    if not more:
        return text
    return f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{more}"


def _truncate(text: str, cap: int):
    data = text.encode("utf-8", "replace")
    if len(data) <= cap:
        return text, False
    return data[:cap].decode("utf-8", "ignore"), True


# How long a kill waits for bwrap's child-pid report that is not read yet (it is written
# within milliseconds of the sandbox's start).
_INFO_WAIT_S = 1.0


def _drain_info(info, head: bytearray, limit: int, deadline: float) -> None:
    """Read bwrap's ``--info-fd`` pipe into ``head`` until it closes, is full or ``deadline``."""
    while len(head) < limit and not _complete_json(head):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        ready, _, _ = select.select([info], [], [], remaining)
        if not ready:
            return
        data = os.read(info.fileno(), limit - len(head))
        if not data:
            return
        head += data


def _complete_json(data: bytearray) -> bool:
    try:
        json.loads(bytes(data).decode("utf-8"))
    except ValueError:
        return False
    return True


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


def _child_pid(info: bytes) -> Optional[int]:
    """bwrap's ``child-pid`` report, or None."""
    try:
        return int(json.loads(info.decode("utf-8"))["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _open_sandbox_pid(info: bytes, bwrap_pid: int) -> Optional[int]:
    """A pidfd for the sandbox's first process (bwrap's ``child-pid``), if it is still ours.

    The pidfd pins the process: a signal sent through it cannot reach a later process that
    reused the number. It is kept only if that process's parent is our bwrap.
    """
    pid = _child_pid(info)
    try:
        fd = os.pidfd_open(pid) if pid is not None else None
    except (OSError, AttributeError):
        return None
    if fd is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = None
    if ppid != bwrap_pid:
        os.close(fd)
        return None
    return fd


def _stop(proc: subprocess.Popen, sandbox_pidfd: Optional[int]):
    """Stop whatever runs and reap bwrap; returns its wait status.

    The sandbox's first process is killed first, which takes its whole PID namespace with
    it; bwrap then reaps it and exits by itself (killing bwrap first would orphan that
    process to the host's init). Then the group is killed, in case anything is left.
    """
    if sandbox_pidfd is not None:
        try:
            signal.pidfd_send_signal(sandbox_pidfd, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                return status
            time.sleep(0.002)
    _kill_group(proc)
    _, status = os.waitpid(proc.pid, 0)
    return status


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
