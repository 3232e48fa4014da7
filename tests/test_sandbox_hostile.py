"""Hostile suite for the Python sandbox: each attack must be contained (§22).

Every attack runs in both privilege modes (``drop_privileges`` True and False) and, to
show that the operating system is the boundary, both with and without the in-process
guards (audit hook, import guards). An attack is *contained* when nothing it aimed at
happened, checked from outside the sandbox: files outside are unchanged, no secret,
canary or host metadata reached the output, the outside processes live, no connection
arrived, no process was created, the parent's isolation record is untouched. With the
guards on it must also come back as a tool error (``result.error``) unless it is marked
harmless (it did nothing the code could not do anyway).

Attack code prints ``ESCAPED`` (followed by what it got) only when it succeeded.
"""
from __future__ import annotations

import hashlib
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest

from trajgrad.envs import sandbox as sandbox_module
from trajgrad.envs.sandbox import SandboxedPython

IS_ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[1]

# Prelude shared by the attacks: the real ``os`` and the real builtins, reached without
# the import statement (which the guards watch).
REAL = """
import sys
os = sys.modules['os']
B = sys.modules['builtins']
"""
# Undo the import guards: drop the meta-path finder, use the real __import__.
UNGUARD = REAL + """
sys.meta_path[:] = [f for f in sys.meta_path if 'Block' not in getattr(f, '__name__', repr(f))]
imp = B.__import__
"""


@dataclass(frozen=True)
class Attack:
    name: str
    kind: str
    code: str
    # Extra containment check from outside: check(result, sandbox, ctx) -> problem or None.
    check: Optional[Callable] = None
    # True when the attack, if it "works", does nothing the code could not do anyway.
    harmless: bool = False



def _mount_parents():
    """Folders that exist inside the sandbox only as parents of the bound Python installation
    (a venv under /tmp or /home makes those mount points; they hold nothing of the host's)."""
    out = set()
    for path in {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}:
        p = os.path.realpath(path)
        while True:
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
            if p != "/":
                out.add(p)
    return sorted(out)

def _digest(path):
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def ctx():
    """Outside targets: a canary file, a secret in the environment, a victim process,
    a listening TCP socket, an abstract and a path Unix socket."""
    base = Path(tempfile.mkdtemp(prefix="trajgrad-hostile-"))
    os.chmod(base, 0o755)
    token = f"CANARY-{uuid.uuid4().hex}"
    canary = base / "canary.txt"
    canary.write_text(token + "x" * 12345)
    os.chmod(canary, 0o644)
    secret_name, secret = "TRAJGRAD_TEST_SECRET", f"s3cr3t-{uuid.uuid4().hex}"
    os.environ[secret_name] = secret
    victim = subprocess.Popen(["sleep", "600"])
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    abstract_name = f"trajgrad-test-{uuid.uuid4().hex}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + abstract_name)
    abstract.listen(8)
    abstract.setblocking(False)
    unix_path = str(base / "server.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix.listen(8)
    unix.setblocking(False)
    venv_file = os.path.join(sys.prefix, "pyvenv.cfg")
    if not os.path.exists(venv_file):
        venv_file = os.__file__
    values = dict(
        mount_parents=_mount_parents(),
        base=str(base),
        canary=str(canary),
        token=token,
        target=str(base / f"escape-{uuid.uuid4().hex}.txt"),
        tmp_target=os.path.join(tempfile.gettempdir(), f"trajgrad-escape-{uuid.uuid4().hex}"),
        secret_name=secret_name,
        secret=secret,
        victim=victim.pid,
        parent=os.getpid(),
        port=server.getsockname()[1],
        abstract=abstract_name,
        unix_path=unix_path,
        project_file=str(REPO / "pyproject.toml"),
        git_path=str(REPO / ".git"),
        venv_file=venv_file,
        stdlib_file=os.__file__,
    )
    digests = {k: _digest(values[k]) for k in ("canary", "project_file", "venv_file", "stdlib_file")}
    yield dict(values=values, digests=digests, victim=victim, servers=(server, abstract, unix))
    victim.kill()
    victim.wait()
    for s in (server, abstract, unix):
        s.close()
    for p in sorted(base.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    base.rmdir()
    os.environ.pop(secret_name, None)


def _general_problems(result, sb, ctx, drop):
    v = ctx["values"]
    out = result.output + (result.error or "")
    problems = []
    if "ESCAPED" in out:
        problems.append(f"attack reported success: {out[:300]!r}")
    for key in ("secret", "token"):
        if v[key] in out:
            problems.append(f"{key} leaked")
    if "12345" in out and "st_size" in out:
        problems.append("canary metadata leaked")
    for key in ("target", "tmp_target"):
        if os.path.exists(v[key]):
            problems.append(f"{key} was written")
    for key, digest in ctx["digests"].items():
        if _digest(v[key]) != digest:
            problems.append(f"{key} changed")
    if ctx["victim"].poll() is not None:
        problems.append("the outside victim process was killed")
    ready, _, _ = select.select(list(ctx["servers"]), [], [], 0)
    if ready:
        for s in ready:
            try:
                s.accept()[0].close()
            except OSError:
                pass
        problems.append("a connection reached a server outside")
    lr = sb.last_run
    if lr.get("network_isolated") is not True or lr.get("filesystem_isolated") is not True:
        problems.append(f"isolation record changed: {lr}")
    expected_drop = IS_ROOT and drop
    if lr.get("dropped_privileges") is not expected_drop:
        problems.append(f"privilege record changed: {lr.get('dropped_privileges')}")
    return problems


def _no_fork(result, sb, ctx):
    return "a process was created" if "FORKED" in result.output else None


ATTACKS = [
    # --- time-of-check / time-of-use path objects ------------------------------------
    Attack("toctou-fspath-open", "toctou", """
open('ok.txt', 'w').write('fine')
class P:
    n = 0
    def __fspath__(self):
        P.n += 1
        return 'ok.txt' if P.n == 1 else {canary!r}
got = [open(P()).read() for _ in range(1)] + [open(P()).read()]
print('ESCAPED' if any({token!r} in g for g in got) else 'no', got[0][:10])
"""),
    Attack("toctou-fspath-os-calls", "toctou", REAL + """
open('ok.txt', 'w').write('fine')
class P:
    n = 0
    def __fspath__(self):
        P.n += 1
        return 'ok.txt' if P.n % 2 else '/etc/passwd'
got = []
for call in (lambda: os.open(P(), os.O_RDONLY), lambda: os.stat(P()), lambda: os.listdir(P()),
             lambda: open(P()).read(), lambda: os.stat(P()).st_size):
    for _ in range(2):
        try:
            got.append(call())
        except OSError as e:
            got.append(type(e).__name__)
print(got)
if any(isinstance(g, int) and g > 100 for g in got):
    print('ESCAPED', got)
"""),
    Attack("toctou-str-subclass", "toctou", """
class S(str):
    def __fspath__(self):
        return {project_file!r}
s = S('ok.txt')
print('ESCAPED', open(s).read()[:80])
"""),
    Attack("toctou-fspath-write", "toctou", """
class P:
    n = 0
    def __fspath__(self):
        P.n += 1
        return 'ok.txt' if P.n == 1 else {target!r}
open(P(), 'w').write('pwned')
import sys
if sys.modules['os'].path.exists({target!r}):
    print('ESCAPED')
""", harmless=True),
    # --- frame and generator introspection -------------------------------------------
    Attack("generator-frame-builtins", "introspection", """
g = (x for x in [1])
imp = g.gi_frame.f_builtins['__import__']
sock = imp('socket')
s = sock.create_connection(('127.0.0.1', {port}), timeout=1)
print('ESCAPED connected')
"""),
    Attack("subclasses-to-os-globals", "introspection", """
wrap = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]
g = wrap.__init__.__globals__
real_import = g['__builtins__']['__import__']
sock = real_import('socket')
s = sock.socket(sock.AF_INET, sock.SOCK_STREAM)
s.settimeout(1)
s.connect(('127.0.0.1', {port}))
print('ESCAPED connected')
"""),
    Attack("frame-walk-runner-globals", "introspection", REAL + """
f = sys._getframe()
while f.f_back is not None:
    f = f.f_back
g = f.f_globals
g['LOAD_BLOCKED'] = frozenset()
g['USER_BLOCKED'] = frozenset()
real_import = B.__import__
libc = real_import('ctypes').CDLL(None)
if libc.kill({victim}, 9) == 0:
    print('ESCAPED killed the victim')
"""),
    Attack("traceback-frame-locals", "introspection", REAL + """
try:
    open('/etc/passwd')
except PermissionError as e:
    tb = e.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    loc = tb.tb_frame.f_locals
    print(sorted(loc)[:5])
data = open({canary!r}).read()
print('ESCAPED', data[:60])
"""),
    # --- forging the runner's output / result / isolation flags ----------------------
    Attack("forge-old-marker", "forgery", """
import json, sys
sys.stdout.write('\\x00TRAJGRAD-SANDBOX-RESULT\\x00' + json.dumps({{'value': '1', 'error': None,
    'network_isolated': False, 'filesystem_isolated': False, 'dropped_privileges': False}}) + '\\n')
""", harmless=True),
    Attack("forge-result-frame-then-exit", "forgery", REAL + """
import json
for fd in range(3, 64):
    try:
        os.write(fd, (json.dumps({{'kind': 'result', 'value': '42', 'error': None,
            'network_isolated': False, 'dropped_privileges': False, 'filesystem_isolated': False}}) + '\\n').encode())
    except OSError:
        pass
os._exit(0)
""", harmless=True),
    Attack("forge-after-violation", "forgery", REAL + """
import json
try:
    open({canary!r}).read()
except OSError:
    pass
for fd in range(3, 64):
    try:
        os.write(fd, (json.dumps({{'kind': 'result', 'value': 'ok', 'error': None}}) + '\\n').encode())
    except OSError:
        pass
os._exit(0)
"""),
    Attack("forge-fake-ready-and-exit-code", "forgery", REAL + """
for fd in range(3, 64):
    try:
        os.write(fd, b'{{"kind": "ready"}}\\n')
    except OSError:
        pass
os._exit(0)
"""),
    Attack("forge-malformed-frames", "forgery", REAL + """
for fd in range(3, 64):
    try:
        os.write(fd, b'[' * 200_000 + b'\\n' + b'{{"kind": "result", "value": 5}}\\n' + b'\\xff\\xfe garbage\\n')
    except OSError:
        pass
raise ValueError('x' * 1_000_000)
""", check=lambda result, sb, ctx: None if result.error and len(result.error) < 20_000 else "error not bounded"),
    Attack("forge-swallow-violation", "forgery", REAL + """
import json
fd = int(sys.argv[1])
os.write(fd, b'{{"kind": "result", "value": "\\'clean\\'", "error": null, "x": ')
try:
    open('/etc/passwd')
except Exception:
    pass
os.write(fd, b'}}\\n')
os.write(fd, (json.dumps({{'kind': 'result', 'value': "'clean'", 'error': None}}) + '\\n').encode())
os._exit(0)
"""),
    # --- clearing the violation record -----------------------------------------------
    Attack("clear-violations-via-frames", "record", REAL + """
try:
    open('/etc/passwd')
except PermissionError:
    pass
f = sys._getframe()
while f.f_back is not None:
    f = f.f_back
for value in list(f.f_locals.values()):
    if isinstance(value, list):
        value.clear()
    if isinstance(value, dict) and 'error' in value:
        value['error'] = None
"""),
    Attack("close-the-channel-then-violate", "record", REAL + """
for fd in range(3, 64):
    try:
        os.close(fd)
    except OSError:
        pass
data = open({canary!r}).read()
print('ESCAPED', data[:40])
"""),
    Attack("replace-the-channel-then-violate", "record", REAL + """
null = os.open('/dev/null', os.O_WRONLY)
for fd in range(3, 64):
    if fd != null:
        try:
            os.dup2(null, fd)
        except OSError:
            pass
data = open({canary!r}).read()
print('ESCAPED', data[:40])
"""),
    # --- resetting limits -------------------------------------------------------------
    Attack("raise-cpu-limit", "limits", REAL + """
res = sys.modules.get('resource')
try:
    res.setrlimit(res.RLIMIT_CPU, (res.RLIM_INFINITY, res.RLIM_INFINITY))
    print('ESCAPED raised')
except Exception as e:
    print('refused', type(e).__name__)
while True:
    pass
"""),
    Attack("raise-memory-limit", "limits", REAL + """
res = sys.modules.get('resource')
try:
    res.setrlimit(res.RLIMIT_AS, (res.RLIM_INFINITY, res.RLIM_INFINITY))
    print('ESCAPED raised')
except Exception as e:
    print('refused', type(e).__name__)
x = bytearray(2 * 1024 ** 3)
print('ESCAPED allocated')
"""),
    Attack("raise-nproc-then-fork", "limits", REAL + """
res = sys.modules.get('resource')
try:
    res.setrlimit(res.RLIMIT_NPROC, (1000, 1000))
except Exception as e:
    pass
try:
    pid = os.fork()
except Exception as e:
    print('no fork', type(e).__name__)
else:
    if pid == 0:
        os._exit(0)
    print('FORKED', pid)
""", check=_no_fork),
    # --- fresh built-in modules -------------------------------------------------------
    Attack("fresh-posix-system", "fresh-modules", REAL + """
bs = sys.modules['_frozen_importlib']
posix = sys.modules['_imp'].create_builtin(bs.ModuleSpec('posix', None, origin='built-in'))
rc = posix.system('echo ESCAPED > ok.txt; echo ESCAPED > {target}')
print('rc', rc, 'FORKED' if rc == 0 else '')
""", check=_no_fork),
    Attack("fresh-posixsubprocess", "fresh-modules", UNGUARD + """
ext = sys.modules['_frozen_importlib_external']
bs = sys.modules['_frozen_importlib']
spec = ext.PathFinder.find_spec('_posixsubprocess')
mod = bs.module_from_spec(spec)
spec.loader.exec_module(mod)
r, w = os.pipe()
args = [[b'/bin/sh', b'-c', b'echo ESCAPED > {target}'], [b'/bin/sh'], True, (), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False]
pid = mod.fork_exec(*args)
print('FORKED', pid)
""", check=_no_fork),
    Attack("ctypes-libc-calls", "fresh-modules", UNGUARD + """
ctypes = imp('ctypes')
libc = ctypes.CDLL(None, use_errno=True)
results = {{
    'unshare': libc.unshare(0x10000000 | 0x00020000),
    'mount': libc.mount(b'proc', b'/sandbox', b'proc', 0, None),
    'ptrace': libc.ptrace(16, 1, 0, 0),
    'kill_victim': libc.kill({victim}, 9),
    'chroot': libc.chroot(b'/sandbox'),
    'fork': libc.fork(),
}}
if results['fork'] == 0:
    libc._exit(0)
print(results)
if any(v == 0 for k, v in results.items() if k != 'fork') or results['fork'] > 0:
    print('ESCAPED', results)
"""),
    Attack("subprocess-real-import", "fresh-modules", UNGUARD + """
sp = imp('subprocess')
out = sp.run(['/bin/sh', '-c', 'cat /etc/passwd; env'], capture_output=True)
print('ESCAPED', out)
"""),
    # --- threads ------------------------------------------------------------------------
    Attack("thread-outlives-result", "threads", UNGUARD + """
th = imp('_thread')
def later():
    import time
    time.sleep(0.3)
    open({tmp_target!r}, 'w').write('late')
try:
    th.start_new_thread(later, ())
    print('thread started')
except Exception as e:
    print('refused', type(e).__name__)
""", harmless=True),
    Attack("thread-bomb", "threads", UNGUARD + """
th = imp('_thread')
import time
n = 0
try:
    for _ in range(5000):
        th.start_new_thread(time.sleep, (5,))
        n += 1
except Exception as e:
    print('stopped after', n, type(e).__name__)
if n >= 5000:
    print('ESCAPED', n)
""", harmless=True),
    # --- sockets (network) ------------------------------------------------------------
    Attack("tcp-to-host-localhost", "network", UNGUARD + """
sock = imp('socket')
s = sock.socket(sock.AF_INET, sock.SOCK_STREAM)
s.settimeout(1)
s.connect(('127.0.0.1', {port}))
print('ESCAPED connected')
"""),
    Attack("abstract-unix-socket", "network", UNGUARD + """
sock = imp('socket')
s = sock.socket(sock.AF_UNIX, sock.SOCK_STREAM)
s.connect('\\0{abstract}')
print('ESCAPED connected')
"""),
    Attack("path-unix-socket", "network", UNGUARD + """
sock = imp('socket')
s = sock.socket(sock.AF_UNIX, sock.SOCK_STREAM)
s.connect({unix_path!r})
print('ESCAPED connected')
"""),
    Attack("dns-and-outside-address", "network", UNGUARD + """
sock = imp('socket')
try:
    print('ESCAPED', sock.getaddrinfo('example.com', 80))
except OSError as e:
    print('no dns', e)
s = sock.socket(sock.AF_INET, sock.SOCK_STREAM)
s.settimeout(1)
s.connect(('1.1.1.1', 80))
print('ESCAPED connected')
"""),
    # --- signals to other processes ---------------------------------------------------
    Attack("kill-victim-and-parent", "signals", REAL + """
import posix
for pid in ({victim}, {parent}):
    try:
        posix.kill(pid, 9)
        print('ESCAPED killed', pid)
    except OSError as e:
        print('no', pid, e)
"""),
    Attack("kill-everything", "signals", UNGUARD + """
ctypes = imp('ctypes')
libc = ctypes.CDLL(None)
libc.kill(1, 9)
libc.kill(-1, 9)
print('survived')
"""),
    # --- disk filling -----------------------------------------------------------------
    Attack("many-files", "disk", REAL + """
written = 0
try:
    for i in range(400):
        with open(f'f{{i}}', 'w') as fh:
            fh.write('x' * 999_999)
        written += 1
except OSError as e:
    print('stopped', written, e)
if written * 999_999 > 64_000_000:
    print('ESCAPED wrote', written)
""", harmless=True),
    Attack("one-huge-file", "disk", """
with open('big', 'wb') as fh:
    for _ in range(100):
        fh.write(b'x' * 1_000_000)
print('ESCAPED wrote 100 MB')
"""),
    # --- metadata probes --------------------------------------------------------------
    Attack("stat-host-files", "metadata", REAL + """
found = {{}}
for p in ['/etc/passwd', '/etc/shadow', {canary!r}, {project_file!r}, {git_path!r}, '/home', '/proc/1', '/tmp']:
    if p in {mount_parents!r}:
        continue  # a parent folder of the bound Python installation (an empty mount point)
    try:
        st = os.stat(p)
        found[p] = st.st_size
    except OSError:
        pass
if found:
    print('ESCAPED', found)
""", harmless=True),
    Attack("listdir-and-exists", "metadata", UNGUARD + """
found = [p for p in ['/etc', '/tmp', '/home', '/proc', {base!r}, {git_path!r}, {project_file!r}]
         if os.path.exists(p) and p not in {mount_parents!r}]
if found:
    print('ESCAPED', found)
print(os.listdir('/'))
"""),
    Attack("git-config-relative", "metadata", REAL + """
hits = []
for rel in ['.git/config', '../.git/config', '../../.git/config', '../../../.git/config']:
    if os.path.exists(rel):
        hits.append(rel)
if hits:
    print('ESCAPED', hits)
""", harmless=True),
    # --- the parent's environment -----------------------------------------------------
    Attack("read-environment", "environment", REAL + """
env = dict(os.environ)
print(sorted(env))
print(env.get({secret_name!r}))
for p in ['/proc/self/environ', '/proc/1/environ', '/proc/{parent}/environ']:
    try:
        print('ESCAPED', open(p, 'rb').read()[:200])
    except OSError:
        pass
"""),
    Attack("inherited-descriptors", "environment", REAL + """
import stat
for fd in range(3, 64):
    try:
        st = os.fstat(fd)
    except OSError:
        continue
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        print('ESCAPED fd', fd, st)
""", harmless=True),
    # --- writing outside the sandbox --------------------------------------------------
    Attack("write-outside-paths", "write", REAL + """
for p in [{target!r}, {tmp_target!r}, {venv_file!r}, {stdlib_file!r}, {project_file!r}, '/x', '/dev/x']:
    for mode in ('a', 'w'):
        try:
            with open(p, mode) as fh:
                fh.write('pwned')
            if p not in ('/x', '/dev/x'):
                print('ESCAPED wrote', p)
        except OSError:
            pass
"""),
    Attack("rename-and-link-installation", "write", UNGUARD + """
for fn, args in [(os.rename, ({venv_file!r}, 'stolen')), (os.link, ({venv_file!r}, 'hard')),
                 (os.unlink, ({stdlib_file!r},)), (os.chmod, ({venv_file!r}, 0o777))]:
    try:
        fn(*args)
        print('ESCAPED', fn.__name__)
    except Exception as e:
        print('no', fn.__name__, type(e).__name__)
"""),
    # --- descriptors of the sandbox's init, socket families outside the namespace -------
    Attack("pidfd-getfd-init-stdin", "descriptors", REAL + """
import ctypes
fd = ctypes.CDLL(None, use_errno=True).syscall(438, os.pidfd_open(1), 0, 0)
if fd >= 0:
    os.write(1, b'ESCAPED wrote %d bytes to the init fd 0' % os.write(fd, b'Z' * 500000))
"""),
    Attack("vsock-listen", "network", REAL + """
import _socket
s = _socket.socket(40, _socket.SOCK_STREAM)
s.bind((0xFFFFFFFF, 0xFFFFFFFF))
s.listen()
print('ESCAPED vsock listening on', s.getsockname())
"""),
    # --- privileges and the installation ----------------------------------------------
    Attack("regain-root", "privileges", REAL + """
before = (os.getuid(), os.geteuid())
gained = []
open('mine', 'w').close()
for name, fn in [('setuid', lambda: os.setuid(0)), ('setgid', lambda: os.setgid(0)),
                 ('seteuid', lambda: os.seteuid(0)), ('setgroups', lambda: os.setgroups([0])),
                 ('chown', lambda: os.chown('mine', 0, 0))]:
    try:
        fn()
        gained.append(name)
    except OSError:
        pass
if before != (0, 0) and gained:
    print('ESCAPED', gained)
print(before, gained)
""", harmless=True),
    Attack("symlink-out", "write", REAL + """
os.symlink('/etc/passwd', 'l')
os.symlink({canary!r}, 'c')
print('ESCAPED', open('l').read()[:40], open('c').read()[:40])
"""),
    Attack("overwrite-runner-and-dev", "write", REAL + """
import glob
done = []
for p in glob.glob('/.trajgrad-sandbox/*') + ['/dev/null2', '/dev/shm/x']:
    try:
        open(p, 'a').write('pwned')
        done.append(p)
    except OSError:
        pass
print('ESCAPED' if done else 'nothing', done)
raise SystemExit(1)
"""),
]

IDS = [a.name for a in ATTACKS]


def _sandbox(drop, guards):
    sb = SandboxedPython(timeout_s=8.0, cpu_s=1, memory_mb=256, drop_privileges=drop)
    sb._in_process_guards = guards
    return sb


@pytest.fixture(scope="module")
def sandboxes():
    return {(d, g): _sandbox(d, g) for d in (True, False) for g in (True, False)}


def test_suite_size():
    assert len(ATTACKS) >= 30
    assert len({a.kind for a in ATTACKS}) >= 12


@pytest.mark.parametrize("guards", [True, False], ids=["guards", "os-only"])
@pytest.mark.parametrize("drop", [True, False], ids=["drop", "no-drop"])
@pytest.mark.parametrize("attack", ATTACKS, ids=IDS)
def test_attack_is_contained(attack, drop, guards, sandboxes, ctx):
    sb = sandboxes[(drop, guards)]
    code = attack.code.format(**ctx["values"])
    start = time.monotonic()
    result = sb.run(code)
    elapsed = time.monotonic() - start
    time.sleep(0.35) if attack.name == "thread-outlives-result" else None
    problems = _general_problems(result, sb, ctx, drop)
    if attack.check is not None:
        problem = attack.check(result, sb, ctx)
        if problem:
            problems.append(problem)
    if guards and not attack.harmless and result.error is None:
        problems.append(f"not reported as a tool error: {result}")
    if os.environ.get("TRAJGRAD_HOSTILE_VERBOSE"):
        print(f"\n{attack.name} drop={drop} guards={guards} error={result.error is not None}: {result!r:.300}")
    assert not problems, (attack.name, problems, result, sb.last_run.get("violations"))
    assert elapsed < 8.5


# The same attacks, run by an ordinary user (``nobody``) with the system's Python, which
# has neither torch nor (necessarily) pytest: the package and pytest are stubbed.
_AS_USER = r"""
import importlib.util, sys, types
src, here, guards = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
for name in ("trajgrad", "trajgrad.envs"):
    m = types.ModuleType(name)
    m.__path__ = [src + "/" + name.replace(".", "/")]
    sys.modules[name] = m
fake = types.ModuleType("pytest")
fake.fixture = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
class _Mark:
    def __getattr__(self, name):
        return lambda *a, **k: (lambda f: f)
fake.mark = _Mark()
sys.modules["pytest"] = fake
spec = importlib.util.spec_from_file_location("hostile", here)
H = importlib.util.module_from_spec(spec)
sys.modules["hostile"] = H
spec.loader.exec_module(H)
gen = H.ctx()
ctx = next(gen)
sb = H._sandbox(True, guards)
contained = 0
for attack in H.ATTACKS:
    result = sb.run(attack.code.format(**ctx["values"]))
    if attack.name == "thread-outlives-result":
        import time
        time.sleep(0.35)
    problems = H._general_problems(result, sb, ctx, True)
    if attack.check is not None and attack.check(result, sb, ctx):
        problems.append(attack.check(result, sb, ctx))
    if guards and not attack.harmless and result.error is None:
        problems.append("not reported as a tool error")
    if problems:
        print("PROBLEM", attack.name, problems, result)
    else:
        contained += 1
print("MODE", sb.last_run["mode"])
print("CONTAINED", contained, len(H.ATTACKS))
for _ in gen:
    pass
"""


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="needs root to become an ordinary user")
def test_attacks_are_contained_for_an_ordinary_user():
    """Every attack, OS layers only, with the parent an ordinary user (``nobody``)."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system Python")
    src = str(Path(sandbox_module.__file__).resolve().parents[2])
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    here = str(Path(__file__).resolve())
    if subprocess.run(as_nobody + ["test", "-r", here], cwd="/").returncode != 0:
        pytest.skip("the source tree is not readable by nobody")
    work = tempfile.mkdtemp(prefix="trajgrad-as-user-")
    try:
        os.chmod(work, 0o755)
        script = os.path.join(work, "attacks.py")
        Path(script).write_text(_AS_USER)
        os.chmod(script, 0o644)
        proc = subprocess.run(
            as_nobody + [python, "-I", script, src, here, "0"], capture_output=True, text=True, timeout=300, cwd="/"
        )
    finally:
        shutil.rmtree(work)
    if "No permissions to create new namespace" in proc.stdout + proc.stderr:
        pytest.skip("unprivileged user namespaces are disabled on this kernel")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MODE user-in-userns" in proc.stdout
    assert f"CONTAINED {len(ATTACKS)} {len(ATTACKS)}" in proc.stdout, proc.stdout[-3000:]
