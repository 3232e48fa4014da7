"""Tests for trajgrad.envs.sandbox (normal use, limits, the isolation record) and the safe
arithmetic evaluator. The attack suite is tests/test_sandbox_hostile.py.

Every hostile program must come back as a ToolResult error, quickly, with the parent
process healthy and nothing written outside the sandbox.
"""
from __future__ import annotations

import ast
import hashlib
import operator
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.envs import arithmetic, sandbox as sandbox_module
from trajgrad.envs.arithmetic import count_operations, format_number, safe_eval_arithmetic
from trajgrad.envs.bubblewrap import INSTALL_HINT
from trajgrad.envs.sandbox import SandboxedPython
from trajgrad.envs.seccomp import build_filter
from trajgrad.envs.tools import ToolResult

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(scope="module")
def sandbox():
    # A generous wall time so that a loaded machine still hits the CPU/memory limits first.
    return SandboxedPython(timeout_s=10.0, cpu_s=1, memory_mb=256, max_output_bytes=10_000)


def run_timed(sb, code):
    start = time.monotonic()
    result = sb.run(code)
    return result, time.monotonic() - start


def temp_entries():
    return set(os.listdir(tempfile.gettempdir()))


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The parent's temp dir, made private to one test.

    Other test processes running at the same time create entries in the shared temp dir
    (torchrun's rendezvous files, for one), so "nothing new there" is only checkable in a
    directory no one else writes to. The sandbox's own temp files go where `tempfile` says.
    """
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    return private


# --- normal use ---------------------------------------------------------------------------


def test_expression_value(sandbox):
    assert sandbox.run("2 ** 10") == ToolResult("1024", None)
    assert sandbox.run("sum(i * i for i in range(4))") == ToolResult("14", None)  # 0 + 1 + 4 + 9


def test_statements_print_and_last_value(sandbox):
    result = sandbox.run("x = 6\nprint('x is', x)\nx * 7")
    assert result == ToolResult("x is 6\n42", None)
    # A final None is not shown; print alone gives just the printed text.
    assert sandbox.run("print('hi')") == ToolResult("hi\n", None)
    assert sandbox.run("x = 1") == ToolResult("", None)


def test_preloaded_modules_are_usable(sandbox):
    result = sandbox.run("import math, fractions\nmath.isqrt(17), str(fractions.Fraction(3, 6))")
    assert result == ToolResult("(4, '1/2')", None)


def test_errors_are_reported_with_the_line(sandbox):
    result = sandbox.run("a = 1\nb = a / 0")
    assert result.error == "ZeroDivisionError: division by zero (line 2)"
    assert sandbox.run("def f(:").error.startswith("SyntaxError")
    assert sandbox.run("raise SystemExit(3)").error == "SystemExit: 3"
    assert sandbox.run("input()").error.startswith("EOFError")


def test_output_before_an_error_is_kept(sandbox):
    result = sandbox.run("print('partial')\nraise ValueError('bad')")
    assert result == ToolResult("partial\n", "ValueError: bad (line 2)")


def test_files_in_the_work_dir_are_allowed_and_private_to_one_run(sandbox, private_tmp):
    before = temp_entries()
    result = sandbox.run("open('notes.txt', 'w').write('abc')\nopen('notes.txt').read()")
    assert result == ToolResult("'abc'", None)
    assert "FileNotFoundError" in sandbox.run("open('notes.txt').read()").error  # a fresh tmpfs each run
    assert temp_entries() <= before  # nothing left on the host


def test_disk_quota_is_a_total_not_per_file():
    sb = SandboxedPython(timeout_s=10.0, max_file_bytes=1_000_000, max_disk_bytes=2_000_000)
    code = (
        "n = 0\ntry:\n    for i in range(50):\n        open(f'f{i}', 'w').write('x' * 500_000)\n"
        "        n += 1\nexcept OSError as e:\n    print(e)\nn"
    )
    result = sb.run(code)
    assert "No space left on device" in result.output
    assert int(result.output.split()[-1]) < 4  # 2 MB in total, whatever the number of files


def test_file_size_is_limited(sandbox):
    result = sandbox.run("f = open('big', 'w')\nf.write('x' * 2_000_000)\nf.close()")
    assert "File too large" in result.error


def test_non_text_and_too_long_code_are_refused_without_a_process():
    sb = SandboxedPython(max_code_chars=10)
    assert "must be text" in sb.run(123).error
    assert "too long" in sb.run("1 + 1 + 1 + 1").error


def test_missing_bubblewrap_fails_clearly_instead_of_running_unisolated(tmp_path):
    with pytest.raises(RuntimeError, match="apt-get install -y bubblewrap"):
        SandboxedPython(bwrap=str(tmp_path / "no-such-bwrap"))
    assert "bubblewrap" in INSTALL_HINT
    with pytest.raises(RuntimeError, match="does not support --size"):
        SandboxedPython(bwrap=shutil.which("false") or "/bin/false")
    with pytest.raises(RuntimeError, match="could not start"):
        SandboxedPython(bwrap=str(_fake_bwrap(tmp_path)))


def _fake_bwrap(tmp_path):
    """An executable that advertises bwrap's options but cannot start anything."""
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\nif [ \"$1\" = --help ]; then echo '--size --perms --remount-ro --die-with-parent "
        "--new-session --clearenv --cap-drop --info-fd'; exit 0; fi\n"
        "echo 'bwrap: No permissions to create new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    return fake


def test_bad_configuration_raises_value_error():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxedPython(timeout_s=0)
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxedPython(cpu_s=0.5)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxedPython(memory_mb=8)
    with pytest.raises(ValueError, match="max_output_bytes"):
        SandboxedPython(max_output_bytes=0)
    with pytest.raises(ValueError, match="max_disk_bytes"):
        SandboxedPython(max_disk_bytes=10)
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxedPython(cpu_s=True)


# --- the hostile suite ---------------------------------------------------------------------


def test_infinite_loop_is_killed_by_the_cpu_limit(sandbox):
    result, elapsed = run_timed(sandbox, "while True:\n    pass")
    assert result.output == ""
    assert "CPU time limit exceeded (1 s)" in result.error
    assert elapsed < 10.0


def test_sleeping_code_is_killed_by_the_wall_limit():
    sb = SandboxedPython(timeout_s=1.0)
    result, elapsed = run_timed(sb, "import time\ntime.sleep(60)")
    assert result.error == "wall-time limit exceeded (1 s); the process was killed"
    assert elapsed < 4.0


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import sys\nos = sys.modules['os']\nwhile True:\n    os.fork()",
        "import sys\nsys.modules['os'].system('echo escaped')",
        "import sys\nos = sys.modules['os']\nos.execv('/bin/sh', ['sh', '-c', 'echo escaped'])",
        "import sys\nos = sys.modules['os']\nos.posix_spawn('/bin/sh', ['sh'], {})",
        "import sys\nsys.modules['os'].kill(1, 9)",
    ],
    ids=["fork-bomb", "fork-via-sys-modules", "system", "exec", "posix-spawn", "kill"],
)
def test_process_creation_is_refused(sandbox, code):
    result, elapsed = run_timed(sandbox, code)
    assert "not allowed" in result.error
    assert "escaped" not in result.output
    assert elapsed < 5.0


def test_memory_bomb_single_allocation(sandbox):
    result, elapsed = run_timed(sandbox, "x = 'x' * 10**10")
    assert result.error == "MemoryError: memory limit exceeded (256 MB)"
    assert elapsed < 5.0


def test_memory_bomb_growing_list(sandbox):
    result, elapsed = run_timed(sandbox, "chunks = []\nwhile True:\n    chunks.append(' ' * 10**6)")
    assert "MemoryError" in result.error or "CPU time" in result.error
    assert elapsed < 10.0


@pytest.mark.parametrize("where", ["tmp", "home", "etc"])
def test_writes_outside_the_temp_dir_are_refused(sandbox, where):
    name = f"trajgrad-escape-{uuid.uuid4().hex}.txt"
    target = {
        "tmp": os.path.join(tempfile.gettempdir(), name),
        "home": os.path.join(os.path.expanduser("~"), name),
        "etc": "/etc/passwd",
    }[where]
    before = _digest(target)
    for code in (
        f"open({target!r}, 'a').write('pwned')",
        f"import sys\nos = sys.modules['os']\nos.open({target!r}, os.O_WRONLY | os.O_CREAT)",
        f"import sys\nsys.modules['os'].remove({target!r})",
        f"import sys\nsys.modules['os'].truncate({target!r}, 0)",
    ):
        result = sandbox.run(code)
        assert "writing outside the sandbox directory is not allowed" in result.error, code
        assert _digest(target) == before


def test_file_functions_without_audit_events_are_refused(sandbox):
    target = os.path.join(tempfile.gettempdir(), f"trajgrad-fifo-{uuid.uuid4().hex}")
    result = sandbox.run(f"import sys\nsys.modules['os'].mkfifo({target!r})")
    assert "creating special files is not allowed (os.mkfifo)" in result.error
    assert not os.path.exists(target)


def test_reads_outside_are_refused(sandbox):
    result = sandbox.run("open('/etc/passwd').read()")
    assert "reading outside the sandbox directory" in result.error
    assert "root:" not in result.output
    result = sandbox.run(f"open({os.path.join(os.path.expanduser('~'), '.bashrc')!r}).read()")
    assert "reading outside" in result.error


def test_violation_caught_by_user_code_is_still_reported(sandbox):
    result = sandbox.run(
        "try:\n    open('/tmp/x-trajgrad', 'w')\nexcept Exception:\n    pass\nprint('carried on')"
    )
    assert result.output == "carried on\n"
    assert result.error.startswith("sandbox: writing outside the sandbox directory")


def test_network_connection_to_localhost_is_refused(sandbox):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}))",
            f"s = __import__('socket')\ns.create_connection(('127.0.0.1', {port}))",
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/')",
            f"import http.client\nhttp.client.HTTPConnection('127.0.0.1', {port}).request('GET', '/')",
        ):
            result = sandbox.run(code)
            assert result.error is not None, code
        ready, _, _ = select.select([server], [], [], 0.2)
        assert ready == []  # nobody ever connected
    finally:
        server.close()


@pytest.mark.parametrize("module", ["os", "subprocess", "socket", "ctypes", "shutil", "multiprocessing"])
def test_dangerous_imports_are_refused(sandbox, module):
    result = sandbox.run(f"import {module}")
    assert f"import of '{module}' is not allowed" in result.error


@pytest.mark.parametrize("code", ["from os import path", "__import__('os')", "import os.path as p"])
def test_other_import_forms_are_refused(sandbox, code):
    error = sandbox.run(code).error
    assert "import of 'os" in error and "is not allowed" in error


def test_import_machinery_is_not_a_way_around(sandbox):
    assert "import of 'importlib' is not allowed" in sandbox.run("import importlib").error
    assert "import of 'gc' is not allowed" in sandbox.run("import gc").error


def test_large_output_is_truncated_to_the_cap(sandbox):
    # Within the pipe budget: the output is cut to the cap, the run completes.
    result = sandbox.run("for _ in range(5):\n    print('y' * 50_000)")
    assert len(result.output.encode()) == 10_000 and set(result.output) == {"y"}
    assert result.error == "output truncated to 10000 bytes"
    result = sandbox.run("'z' * 20_000")
    assert len(result.output) == 10_000 and "truncated" in result.error
    # Beyond it: the parent kills the sandbox and keeps the first bytes.
    result, elapsed = run_timed(sandbox, "import sys\nsys.stdout.write('x' * 10**8)")
    assert result.output == "x" * 10_000
    assert result.error == "output limit exceeded (10000 bytes); the process was killed"
    assert elapsed < 8.0


def _still_there(pids):
    """Those of ``pids`` that still exist as a sandbox process (bwrap or the runner), a
    zombie included. Only this test's own sandboxes are looked at: other test workers'
    processes, re-parented to a slow-reaping init, are not counted."""
    left = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        if comm in ("bwrap", "python", os.path.basename(sys.executable)[:15]):
            left.add(pid)
    return left


def test_killed_sandboxes_leave_no_processes_behind():
    sb = SandboxedPython(timeout_s=0.8, max_output_bytes=100)
    pids = set()
    assert "wall-time" in sb.run("import time\ntime.sleep(30)").error
    pids |= {p for p in sb.last_run["pids"].values() if p is not None}
    assert "output limit" in sb.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)").error
    pids |= {p for p in sb.last_run["pids"].values() if p is not None}
    assert len(pids) == 4  # bwrap and the sandbox's first process, twice
    # bwrap's outer process may exit before its PID-namespace init is reaped (on a normal
    # exit too); that init is then re-parented to the host's init, which reaps it. What
    # must not happen is a sandbox left running or a zombie that stays.
    deadline = time.monotonic() + 10.0
    while _still_there(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _still_there(pids) == set()


def test_raw_descriptor_flood_is_killed_by_the_parent(sandbox):
    result, elapsed = run_timed(sandbox, "import sys\nos = sys.modules['os']\nos.write(1, b'x' * 10**8)")
    assert result.error == "output limit exceeded (10000 bytes); the process was killed"
    assert elapsed < 8.0


def test_guards_hold_without_privilege_drop():
    """The in-process guards alone (what a non-root user gets) contain the same attacks."""
    sb = SandboxedPython(timeout_s=10.0, drop_privileges=False)
    target = os.path.join(tempfile.gettempdir(), f"trajgrad-escape-{uuid.uuid4().hex}.txt")
    assert "not allowed" in sb.run("import sys\nsys.modules['os'].fork()").error
    assert "not allowed" in sb.run(f"open({target!r}, 'w').write('x')").error
    assert not os.path.exists(target)
    assert "import of 'socket' is not allowed" in sb.run("import urllib.request").error
    assert sb.run("6 * 7") == ToolResult("42", None)
    assert sb.last_run["dropped_privileges"] is False


@pytest.mark.skipif(not IS_ROOT, reason="a root parent drops to nobody")
def test_root_parent_runs_the_child_unprivileged_and_isolated(sandbox):
    assert sandbox.run("import sys\nsys.modules['os'].getuid()") == ToolResult("65534", None)
    assert sandbox.last_run["mode"] == "nobody"
    assert sandbox.last_run["dropped_privileges"] is True
    assert sandbox.last_run["network_isolated"] is True
    assert sandbox.last_run["filesystem_isolated"] is True
    assert sandbox.last_run["process_limit"] is True


def test_isolation_record_is_the_parents_plan(sandbox):
    sandbox.run("1")
    plan = sandbox.isolation.as_dict()
    assert {k: sandbox.last_run[k] for k in plan} == plan
    assert plan["isolation"] == "bubblewrap" and plan["work_dir"] == "/sandbox"
    assert {"mount", "pid", "net", "ipc", "uts"} <= set(plan["namespaces"])
    assert sandbox.last_run["seccomp"] is (build_filter() is not None)


@pytest.mark.parametrize("drop", [True, False], ids=["drop", "no-drop"])
def test_os_layers_hold_without_the_in_process_guards(drop):
    """With the audit hook and import guards off, the OS layers alone contain the code."""
    sb = SandboxedPython(timeout_s=10.0, drop_privileges=drop)
    sb._in_process_guards = False
    name = f"trajgrad-escape-{uuid.uuid4().hex}"
    outside = os.path.join(tempfile.gettempdir(), name)
    # seccomp (and RLIMIT_NPROC = 0 where it binds): no fork, no shell.
    assert "PermissionError: [Errno 1] Operation not permitted" in sb.run("import os\nos.fork()").error
    result = sb.run("import os\nos.system('echo x > made.txt')\nos.path.exists('made.txt')")
    assert result == ToolResult("False", None)
    if sb.last_run["process_limit"]:
        assert "can't start new thread" in sb.run("import _thread\n_thread.start_new_thread(print, ())").error
    # The host's files are not there; the root and the installation are read-only.
    # (a read-only mount point where the Python installation lives below the temp folder)
    error = sb.run(f"open({outside!r}, 'w')").error
    assert "No such file or directory" in error or "Read-only file system" in error
    assert not os.path.exists(outside)
    assert "No such file or directory" in sb.run("open('/etc/passwd')").error
    assert "Read-only file system" in sb.run("open('../' + 'escape.txt', 'w')").error
    error = sb.run(f"open({os.__file__!r}, 'a')").error
    assert "Read-only file system" in error or "Permission denied" in error
    assert not os.path.exists(outside)
    # Nothing of the parent's environment.
    os.environ["TRAJGRAD_SANDBOX_TEST_SECRET"] = "hunter2"
    try:
        result = sb.run("import os\nsorted(os.environ)")
    finally:
        del os.environ["TRAJGRAD_SANDBOX_TEST_SECRET"]
    assert result == ToolResult("['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']", None)
    # The work directory stays writable.
    assert sb.run("open('ok.txt', 'w').write('fine')") == ToolResult("4", None)


def test_seccomp_filter_is_well_formed():
    prog = build_filter("x86_64")
    assert prog is not None and len(prog) % 8 == 0 and len(prog) // 8 < 4096
    assert build_filter("aarch64") is not None
    assert build_filter("riscv-unknown") is None


_AS_USER = r"""
import importlib, sys, types
src = sys.argv[1]
for name in ("trajgrad", "trajgrad.envs"):
    m = types.ModuleType(name)
    m.__path__ = [src + "/" + name.replace(".", "/")]
    sys.modules[name] = m
sb = importlib.import_module("trajgrad.envs.sandbox").SandboxedPython(timeout_s=10.0)
print(sb.run("6 * 7"))
print(sb.last_run["mode"], sb.last_run["uid"], sb.last_run["dropped_privileges"], sb.last_run["process_limit"])
print(sb.last_run["read_only"])
sb._in_process_guards = False
print(sb.run("import os\n(os.getuid(), os.path.exists('/etc/passwd'), os.path.exists(%r))" % sys.argv[0]))
print(sb.run("import os\nos.fork()").error)
print(sb.run("import _thread\n_thread.start_new_thread(print, ())").error)
"""


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="needs root to become an ordinary user")
def test_ordinary_user_gets_a_user_namespace():
    """As an ordinary user (here ``nobody``, with the system's Python, which it can read)."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system Python")
    src = str(Path(sandbox_module.__file__).resolve().parents[2])
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run(as_nobody + ["test", "-r", os.path.join(src, "trajgrad/envs/sandbox.py")], cwd="/")
    if probe.returncode != 0:
        pytest.skip("the source tree is not readable by nobody")
    work = tempfile.mkdtemp(prefix="trajgrad-as-user-")
    try:
        os.chmod(work, 0o755)
        script = os.path.join(work, "as_user.py")
        Path(script).write_text(_AS_USER)
        os.chmod(script, 0o644)
        proc = subprocess.run(
            as_nobody + [python, "-I", script, src], capture_output=True, text=True, timeout=120, cwd="/"
        )
    finally:
        shutil.rmtree(work)
    if "No permissions to create new namespace" in proc.stdout + proc.stderr:
        pytest.skip("unprivileged user namespaces are disabled on this kernel")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert lines[0] == "ToolResult(output='42', error=None)"
    assert lines[1] == "user-in-userns 65534 False True"
    read_only = ast.literal_eval(lines[2])
    assert "/usr" not in read_only and "/" not in read_only  # a system prefix is not bound whole
    assert os.path.realpath(python) in read_only
    assert lines[3] == "ToolResult(output='(65534, False, False)', error=None)"
    assert "Operation not permitted" in lines[4]
    assert "can't start new thread" in lines[5]


def test_bubblewrap_command_line():
    from trajgrad.envs import bubblewrap

    iso = bubblewrap.plan(True, 1_000_000)
    argv = bubblewrap.command("/usr/bin/bwrap", iso, "/r.py", "/py", ["-I"], seccomp_fd=5, info_fd=6)
    joined = " ".join(argv)
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                 "--new-session", "--clearenv", "--remount-ro /", "--size 1000000 --tmpfs /sandbox",
                 "--seccomp 5", "--info-fd 6", "--ro-bind /r.py /.trajgrad-sandbox/runner.py"):
        assert flag in joined, flag
    bound = [argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--ro-bind", "--dev-bind")]
    assert sorted(bound) == sorted(list(iso.read_only) + ["/r.py"])
    assert "--bind" not in argv and "--dev-bind" not in argv  # nothing writable from the host
    assert argv[argv.index("--") + 1:] == ["/py", "-I"]
    assert bubblewrap._symlink_chain("/proc/self/exe")[-1] == os.path.realpath("/proc/self/exe")
    assert bubblewrap._outermost(["/a/b", "/a", "/c/d", "/c/d/e"]) == ["/a", "/c/d"]


def test_arithmetic_helpers_are_still_importable_from_the_sandbox_module():
    assert sandbox_module.safe_eval_arithmetic is arithmetic.safe_eval_arithmetic
    assert sandbox_module.count_operations is arithmetic.count_operations
    assert sandbox_module.format_number is arithmetic.format_number


def test_concurrent_runs_from_threads(sandbox):
    from concurrent.futures import ThreadPoolExecutor

    codes = [f"print({i})\n{i} * {i}" for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(sandbox.run, codes))
    assert results == [ToolResult(f"{i}\n{i * i}", None) for i in range(6)]


def test_parent_is_healthy_after_the_hostile_suite(sandbox, private_tmp):
    before = temp_entries()
    result, elapsed = run_timed(sandbox, "sum(range(101))")
    assert result == ToolResult("5050", None)
    assert elapsed < 5.0
    assert temp_entries() <= before


def _digest(path):
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except FileNotFoundError:
        return None


# --- safe arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("7 / 2", 3.5),
        ("-(3)", -3),
        ("+4 - -4", 8),
        ("1.5 * 2", 3.0),
        ("12 + 7 * 31 - 5", 224),
        ("  100 - 1  ", 99),
    ],
)
def test_safe_eval_values(expr, expected):
    value = safe_eval_arithmetic(expr)
    assert value == expected
    assert type(value) is type(expected)


def test_exact_integer_division_stays_an_integer():
    assert safe_eval_arithmetic("6 / 3") == 2 and isinstance(safe_eval_arithmetic("6 / 3"), int)
    assert safe_eval_arithmetic("1 / 3") == pytest.approx(0.3333333333333333)


@pytest.mark.parametrize(
    "expr",
    [
        "x",
        "__import__('os')",
        "abs(-1)",
        "(1).real",
        "'a'",
        "True",
        "[1]",
        "1 if 1 else 2",
        "1 < 2",
        "1 << 2",
        "1 & 2",
        "1j",
        "1_000",
        "lambda: 1",
        "",
        "1 +",
    ],
)
def test_safe_eval_rejects_everything_but_arithmetic(expr):
    with pytest.raises(ValueError, match="expr"):
        safe_eval_arithmetic(expr)


@pytest.mark.parametrize(
    "expr",
    [
        "9 ** 9 ** 9",
        "10 ** 5000",
        "2 ** 4097",
        "2 ** 4096 * 2 ** 4096",
        "2.0 ** 100000",
        "1e308 * 10",
        "1 / 0",
        "1 // 0",
        "1 % 0",
        "0 ** -1",
        "(-8) ** 0.5",
        "(" * 300 + "1" + ")" * 300,
        "1 + " * 600 + "1",
    ],
)
def test_safe_eval_rejects_huge_or_undefined(expr):
    start = time.monotonic()
    with pytest.raises(ValueError, match="expr"):
        safe_eval_arithmetic(expr)
    assert time.monotonic() - start < 1.0


def test_safe_eval_rejects_non_strings():
    with pytest.raises(ValueError, match="expr"):
        safe_eval_arithmetic(12)


def test_count_operations_and_format_number():
    assert count_operations("1 + 2 * 3") == 2
    assert count_operations("-5") == 0
    assert count_operations("(-5) * -2") == 1
    assert format_number(3.0) == "3"
    assert format_number(3.5) == "3.5"
    assert format_number(1 / 3) == "0.333333333333"
    assert format_number(-12) == "-12"


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}


@settings(max_examples=40, deadline=None)
@given(a=st.integers(-10**6, 10**6), b=st.integers(-10**6, 10**6), op=st.sampled_from(sorted(_OPS)))
def test_safe_eval_matches_python_integer_arithmetic(a, b, op):
    text = f"{a} {op} ({b})"
    if op in ("//", "%") and b == 0:
        with pytest.raises(ValueError, match="expr"):
            safe_eval_arithmetic(text)
        return
    assert safe_eval_arithmetic(text) == _OPS[op](a, b)


def _trees(depth):
    """(text, value, number of operations) of random fully parenthesized expressions."""
    leaf = st.integers(0, 999).map(lambda v: (str(v), v, 0))
    if depth == 0:
        return leaf

    def combine(args):
        (lt, lv, ln), op, (rt, rv, rn) = args
        return (f"({lt}) {op} ({rt})", _OPS[op](lv, rv), ln + rn + 1)

    return st.one_of(
        leaf, st.tuples(_trees(depth - 1), st.sampled_from(["+", "-", "*"]), _trees(depth - 1)).map(combine)
    )


@settings(max_examples=40, deadline=None)
@given(tree=_trees(3))
def test_safe_eval_of_nested_expressions(tree):
    text, value, n_ops = tree
    assert safe_eval_arithmetic(text) == value
    assert count_operations(text) == n_ops
