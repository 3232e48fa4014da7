"""The vLLM server trajgrad owns (``rollout.backend: vllm``): a server that dies mid-step is restarted
once (its episodes dropped); with no restart left it is one clear error and nothing is trained; no
server outlives trajgrad, even when trajgrad is SIGKILLed."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _vllm import vllm_unavailable  # noqa: E402

pytestmark = pytest.mark.skipif(bool(vllm_unavailable()), reason=vllm_unavailable() or "-")

_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from _vllm import build_test_model, vllm_train_config
from trajgrad.train.trainer import Trainer
run = Path({run!r})
build_test_model(run.parent / "model")
cfg = vllm_train_config(run.parent / "model", rollout={{"backend": "vllm", "vllm": {{"restarts": {restarts},
    "python": {python!r}, "extra_args": {args!r}}}}}, sampling={{"temperature": 1.0, "max_new_tokens": 256}},
    train={{"steps": 10000}})  # never ends on its own: the test kills the server, then trajgrad
Trainer(cfg, run, console=lambda *a: print(*a, flush=True)).run()
print("FINISHED", flush=True)
"""


def _group(pgid: int):
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _start(tmp_path, restarts=0):
    from _vllm import SERVER_ARGS, vllm_python

    run = tmp_path / "run"
    code = _SCRIPT.format(tests=os.path.dirname(__file__), run=str(run), python=vllm_python(), args=SERVER_ARGS,
                          restarts=restarts)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True)
    lines = []
    deadline = time.monotonic() + 600
    for line in proc.stdout:  # until the server is healthy
        lines.append(line)
        if "vllm: healthy" in line or time.monotonic() > deadline:
            break
    assert any("vllm: healthy" in x for x in lines), "".join(lines[-30:])
    watchdog = next(p for p in _group_leaders() if str(run) in _cmdline(p))
    return proc, run, watchdog, lines


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _group_leaders():
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _is_leader(int(d.name))]


def _is_leader(pid):
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _wait_gone(pgid, seconds=30.0):
    deadline = time.monotonic() + seconds
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _group(pgid)


def _train_rows(run):
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("kind") == "train"]


def _kill_server_mid_step(lines, pgid, run):
    """SIGKILL the vLLM API server of group ``pgid`` while it runs requests (its /metrics say so); returns
    the train rows written before the kill (the step in flight has not written one)."""
    import httpx

    url = next(x.split("server on ")[1].split()[0] for x in lines if "starting the server on" in x)
    deadline = time.monotonic() + 300
    seen = False
    while not seen and time.monotonic() < deadline:
        try:
            text = httpx.get(url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            text = ""
        running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
        seen = bool(running) and float(running[0].split()[-1]) >= 1
        if not seen:
            time.sleep(0.05)
    assert seen, "the server never reported a running request within 300 s"
    server = [p for p in _group(pgid) if p != pgid and "api_server" in _cmdline(p)]
    assert server, [(p, _cmdline(p)) for p in _group(pgid)]
    before = _train_rows(run)
    os.kill(server[0], signal.SIGKILL)
    return before


def test_server_restarted_once_then_sigkill_of_trajgrad_leaves_no_server(tmp_path):
    proc, run, pgid, lines = _start(tmp_path, restarts=1)
    assert len(_group(pgid)) >= 2  # the watchdog and the vLLM server (and its engine processes)
    _kill_server_mid_step(lines, pgid, run)
    deadline = time.monotonic() + 600
    for line in proc.stdout:  # the episodes in flight are dropped and the server restarted
        lines.append(line)
        if "vllm: healthy" in line or time.monotonic() > deadline:
            break
    text = "".join(lines)
    assert "episodes dropped, never trained" in text and text.count("vllm: healthy") == 2, text[-3000:]
    assert _wait_gone(pgid) == []  # the dead server's group is gone
    second = next(p for p in _group_leaders() if str(run) in _cmdline(p))
    assert second != pgid
    proc.kill()  # SIGKILL of trajgrad: no atexit, no finally
    proc.wait(timeout=30)
    assert _wait_gone(second) == [], "vLLM processes outlived trajgrad"


def test_server_killed_mid_step_is_one_clear_error_and_nothing_trained(tmp_path):
    proc, run, pgid, lines = _start(tmp_path)
    before = _kill_server_mid_step(lines, pgid, run)  # the server dies with requests in flight
    out, _ = proc.communicate(timeout=120)
    text = "".join(lines) + out
    assert proc.returncode != 0
    assert "died during a rollout" in text and "nothing of them is trained" in text, text[-3000:]
    assert "FINISHED" not in text
    assert _train_rows(run) == before  # the step whose rollout the server died in trained nothing
    assert _wait_gone(pgid) == [], "vLLM processes outlived the failed run"
