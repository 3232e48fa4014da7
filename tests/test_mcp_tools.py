"""MCP tools with the official `mcp` SDK: a server written with its MCPServer (formerly FastMCP,
tests/_mcp_server.py) over stdio and over streamable HTTP on 127.0.0.1; listing, calls, errors,
timeouts, crashes, per-episode isolation, shared mode, no orphan processes, a training run."""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from trajgrad.envs import Task, ToolEnv, format_tool_call  # noqa: E402
from trajgrad.envs.mcp import MCPTools, close_mcp_servers, mcp_metrics, mcp_server_config  # noqa: E402
from test_byo_model import Scripted  # noqa: E402  (an action backend writing fixed text)

SERVER = str(Path(__file__).with_name("_mcp_server.py"))
ME = __name__
TASK = Task("t0", "train", "What is 2 + 3?", "5")


def stdio(pid_dir, tools=None, **options):
    env = {"MCP_PID_DIR": str(pid_dir), **({"MCP_TOOLS": tools} if tools else {})}
    return {"command": sys.executable, "args": [SERVER], "env": env, **options}


def started(pid_dir):
    return sorted(int(p.name) for p in Path(pid_dir).iterdir())


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids, within=10.0):
    """Every pid has exited and been reaped (no orphan, no zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def call(env, name, **args):
    return env.step(format_tool_call(name, args))


def exact(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_stdio_tools_are_listed_called_and_guarded_and_each_episode_has_its_own_server(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAJGRAD_TEST_SECRET", "s3cret")
    env = ToolEnv([], lambda text, task: float(text.strip() == task.answer), max_turns=12,
                  confirm=lambda name, arg: json.loads(arg)["target"] == "tmp", mcp=[stdio(tmp_path)])
    schemas = {s["function"]["name"]: s for s in env.tool_schemas}
    assert set(schemas) == {"add", "counter", "fail", "rpc_error", "sleep", "crash", "picture", "getenv", "wipe"}
    add = schemas["add"]
    assert add["type"] == "function" and add["function"]["description"] == "Add two integers."
    assert add["function"]["parameters"]["required"] == ["a", "b"]
    assert add["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert len(started(tmp_path)) == 1 and wait_gone(started(tmp_path)) == []  # the listing's server stopped

    msgs = env.reset(TASK)
    assert '"name": "counter"' in msgs[0]["content"]  # the system prompt lists the server's tools
    r = call(env, "add", a=2, b=3)
    assert r.messages == [{"role": "tool", "content": "5"}] and r.info["mcp_calls"] == 1 and r.info["mcp_errors"] == {}
    assert [call(env, "counter").messages[0]["content"] for _ in range(2)] == ["1", "2"]
    r = call(env, "fail", reason="no such row")  # isError result
    assert r.messages[0]["content"] == "error: Error executing tool fail: no such row"
    assert r.info["mcp_errors"] == {"tool": 1}
    r = call(env, "rpc_error")  # a JSON-RPC error
    assert r.messages[0]["content"] == "error: rpc_error: JSON-RPC error -32602: rpc_error refuses every request"
    assert r.info["mcp_errors"] == {"rpc": 1}
    r = call(env, "picture")  # non-text content is described
    assert r.messages[0]["content"] == "a red dot:\n[image content: image/png, 5 bytes, not shown]"
    # destructiveHint: the confirmation hook decides, as for an irreversible Python tool
    assert call(env, "wipe", target="db").messages[0]["content"] == "error: tool 'wipe' was not confirmed; refused"
    assert call(env, "wipe", target="tmp").messages[0]["content"] == "wiped tmp"
    first = [p for p in started(tmp_path) if alive(p)]
    assert len(first) == 1 and os.getpgid(first[0]) == first[0]  # in its own process group
    # the server's environment: the config's env and the SDK's short default list, not the run's
    assert call(env, "getenv", var="MCP_PID_DIR").messages[0]["content"] == str(tmp_path)
    assert call(env, "getenv", var="PATH").messages[0]["content"] == os.environ["PATH"]
    assert call(env, "getenv", var="TRAJGRAD_TEST_SECRET").messages[0]["content"] == ""
    r = env.step("5")  # the final answer ends the episode and its server
    assert r.terminated and r.reward == 1.0 and r.info["mcp_calls"] == 0
    assert wait_gone(first) == []

    # a new episode: a new server (its counter starts again), the task's allowlist applies
    env.reset(Task("t1", "train", "q", "1", metadata={"allowed_tools": ["counter"]}))
    assert [s["function"]["name"] for s in env.tool_schemas] == ["counter"]
    assert call(env, "counter").messages[0]["content"] == "1"
    r = call(env, "add", a=1, b=1)
    assert r.messages[0]["content"] == "error: tool 'add' is not authorized for this task" and r.info["mcp_calls"] == 0
    env.close()
    assert len(started(tmp_path)) == 3 and wait_gone(started(tmp_path)) == []


def test_a_hung_or_crashed_server_is_a_tool_error_and_never_stops_the_episode(tmp_path):
    env = ToolEnv([], lambda text, task: 0.0, max_turns=10, mcp=[stdio(tmp_path, timeout_s=1.0)])
    env.reset(TASK)
    assert call(env, "add", a=1, b=1).messages[0]["content"] == "2"  # the episode's server is up
    t0 = time.monotonic()
    r = call(env, "sleep", seconds=60)
    assert time.monotonic() - t0 < 5
    assert r.messages[0]["content"] == "error: sleep did not answer within timeout_s=1 s"
    assert r.info["mcp_errors"] == {"timeout": 1} and not r.terminated
    assert call(env, "add", a=1, b=2).messages[0]["content"] == "3"  # the server still answers
    r = call(env, "crash")
    assert r.messages[0]["content"].startswith("error: the MCP server exited during crash")
    assert r.info["mcp_errors"] == {"crash": 1}
    r = call(env, "add", a=1, b=2)
    assert r.messages[0]["content"].startswith("error: the MCP server is not running") and r.info["mcp_errors"] == {
        "crash": 1}
    env.close()
    assert wait_gone(started(tmp_path)) == []


def test_a_server_that_does_not_start_for_an_episode_is_a_start_error(tmp_path):
    spec = stdio(tmp_path, tools="add")
    spec["env"]["MCP_START_ONCE"] = str(tmp_path.parent / f"{tmp_path.name}-started")
    env = ToolEnv([], lambda text, task: 0.0, mcp=[spec])  # the listing's server starts
    env.reset(TASK)  # the episode's does not
    r = call(env, "add", a=1, b=1)
    assert r.messages[0]["content"].startswith("error: the MCP server did not start (") and r.info["mcp_errors"] == {
        "start": 1}
    env.close()
    assert wait_gone(started(tmp_path)) == []


def test_shared_mode_keeps_one_server_per_process_and_warns_that_state_may_leak(tmp_path):
    with pytest.warns(UserWarning, match=r"mcp\.0\.shared: .*state may leak between episodes"):
        tools = MCPTools(stdio(tmp_path, tools="counter", shared=True), key="mcp.0")
    envs = [ToolEnv([], lambda text, task: 0.0, mcp=[tools]) for _ in range(2)]
    seen = []
    for env in envs:  # two episodes, e.g. two rollouts of a group
        env.reset(TASK)
        seen.append(call(env, "counter").messages[0]["content"])
        env.close()
    assert seen == ["1", "2"]  # the second episode sees the first one's state
    pids = started(tmp_path)
    assert len(pids) == 2 and len([p for p in pids if alive(p)]) == 1  # the listing's server, then the shared one
    close_mcp_servers()  # run end (also registered at interpreter exit)
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_servers_left_open_are_stopped_when_the_process_exits(tmp_path):
    """A run that ends without closing (its servers stuck in a call, so that closing stdin alone
    would not end them) leaves no server behind: they are stopped at interpreter exit."""
    hung = {"tools": "sleep", "timeout_s": 1.0}
    script = f"""
from trajgrad.envs import Task, ToolEnv, format_tool_call
for spec in {[stdio(tmp_path, **hung), stdio(tmp_path, shared=True, **hung)]!r}:
    env = ToolEnv([], lambda text, task: 0.0, mcp=[spec])
    env.reset(Task("t", "train", "q", "a"))
    r = env.step(format_tool_call("sleep", {{"seconds": 60}}))
    assert r.info["mcp_errors"] == {{"timeout": 1}}, r.info
print("left open")
"""
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:  # a file, not a pipe: the servers inherit it, and a pipe would wait for them
        code = subprocess.run([sys.executable, "-c", script], stdout=fh, stderr=subprocess.STDOUT, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).returncode
    assert code == 0 and "left open" in log.read_text(), log.read_text()[-2000:]
    log.unlink()
    pids = started(tmp_path)
    assert len(pids) == 3 and wait_gone(pids) == []  # the listing (once per server), the episode's, the shared one


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server_on_loopback(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the HTTP server did not start"
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/mcp"
        env = ToolEnv([], lambda text, task: 0.0, max_turns=10, mcp=[{"url": url, "timeout_s": 1.0}])
        assert "counter" in {s["function"]["name"] for s in env.tool_schemas}
        env.reset(TASK)
        assert call(env, "add", a=20, b=22).messages[0]["content"] == "42"
        assert call(env, "counter").messages[0]["content"] == "1"
        r = call(env, "fail", reason="bad")
        assert r.messages[0]["content"] == "error: Error executing tool fail: bad" and r.info["mcp_errors"] == {"tool": 1}
        r = call(env, "sleep", seconds=30)
        assert r.info["mcp_errors"] == {"timeout": 1} and "did not answer within timeout_s=1" in r.messages[0]["content"]
        proc.kill()
        proc.wait(10)
        r = call(env, "add", a=1, b=1)  # the server is gone: a tool error, the episode goes on
        # (broken during the call, or already seen broken by the client's listening stream)
        assert re.match(r"error: the MCP server (connection broke|is not running) \(", r.messages[0]["content"])
        assert r.info["mcp_errors"] == {"crash": 1}
        assert not (r.terminated or r.truncated)
        env.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_bad_configs_and_servers_that_cannot_start_are_one_line_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^mcp\.0: the MCP server 'no-such-mcp-server-xyz' did not start "
                                         r"\(FileNotFoundError"):
        ToolEnv([], lambda t, k: 0.0, mcp=[{"command": "no-such-mcp-server-xyz"}])
    with pytest.raises(ValueError, match=r"^mcp\.0: the MCP server .* did not start"):
        ToolEnv([], lambda t, k: 0.0, mcp=[{"command": sys.executable, "args": ["-c", "import sys; sys.exit(1)"]}])
    with pytest.raises(ValueError, match=r"^mcp\.0: the MCP server 'http://127\.0\.0\.1:\d+/mcp' did not start"):
        ToolEnv([], lambda t, k: 0.0, mcp=[{"url": f"http://127.0.0.1:{_free_port()}/mcp", "startup_timeout_s": 5}])
    for spec, want in [({"command": "x", "url": "http://a"}, r"^tools\.1\.mcp: give exactly one of command"),
                       ({"command": "x", "timeout": 3}, r"^tools\.1\.mcp\.timeout: unknown option"),
                       ({"command": "x", "timeout_s": 0}, r"^tools\.1\.mcp\.timeout_s: expected a positive number"),
                       ({"command": "x", "args": "server.py"}, r"^tools\.1\.mcp\.args: expected a list of strings"),
                       ({"url": "127.0.0.1:8000"}, r"^tools\.1\.mcp\.url: expected an http"),
                       ({"command": "x", "env": {"A": 1}}, r"^tools\.1\.mcp\.env: expected a mapping of strings")]:
        with pytest.raises(ValueError, match=want):
            mcp_server_config({"mcp": spec}, key="tools.1")
    with pytest.raises(ValueError, match=r"^mcp\.0\.irreversible: the server has no tool 'drop'"):
        MCPTools(stdio(tmp_path, tools="counter", irreversible=["drop"]), key="mcp.0")
    with pytest.raises(ValueError, match=r"^mcp: expected a list"):
        ToolEnv([], lambda t, k: 0.0, mcp={"command": "x"})
    # in a task config, the error names the dotted key
    from trajgrad.train.config import load_config

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10)))
    with pytest.raises(ValueError, match=r"task\.options\.tools\.0\.mcp: the MCP server 'no-such-mcp-server-xyz' "
                                         r"did not start"):
        load_config(preset="tiny", overrides={"task.name": "dataset", "task.options": {
            "path": str(rows), "reward": f"{ME}:exact", "max_turns": 2,
            "tools": [{"mcp": {"command": "no-such-mcp-server-xyz"}}]}})


class _FailsAt(Scripted):
    """The scripted backend of test_byo_model, failing at generation call ``fail_at``."""

    def __init__(self, tok, texts, fail_at):
        super().__init__(tok, texts)
        self.fail_at = fail_at

    def generate(self, seqs, generator, **kw):
        if self.calls == self.fail_at:
            raise RuntimeError("the sampler failed")
        return super().generate(seqs, generator, **kw)


def test_rollouts_of_a_group_each_get_their_own_server_and_every_server_stops(tmp_path, tok):
    from trajgrad.rollout.episodes import EpisodeRunner

    tools = MCPTools(stdio(tmp_path, tools="counter"))
    make = lambda: ToolEnv([], lambda text, task: float(text.strip() == "1"), max_turns=3, mcp=[tools])  # noqa: E731
    runner = EpisodeRunner(Scripted(tok, [format_tool_call("counter", {}), "1"]), tok)
    trajs = runner.rollout(make, [TASK], group_size=2, seed=0)
    assert [t.total_reward for t in trajs] == [1.0, 1.0]  # each rollout's counter said 1: no shared state
    assert [t.turns[0].info["mcp_calls"] for t in trajs] == [1, 1]
    assert mcp_metrics(trajs) == {"tools/mcp_calls": 2.0, **{f"tools/mcp_error_frac/{r}": 0.0
                                                             for r in ("start", "timeout", "crash", "rpc", "tool")}}
    assert len(started(tmp_path)) == 3 and wait_gone(started(tmp_path)) == []
    # a rollout that fails midway still stops its episodes' servers
    runner = EpisodeRunner(_FailsAt(tok, [format_tool_call("counter", {})], fail_at=1), tok)
    with pytest.raises(RuntimeError, match="the sampler failed"):
        runner.rollout(make, [TASK], group_size=2, seed=0)
    assert len(started(tmp_path)) == 5 and wait_gone(started(tmp_path)) == []


class _Endless:
    """An environment that never ends an episode itself; the collector cuts it at ``max_turns``."""

    name, max_turns, closed = "endless", 2, []

    def reset(self, task):
        return [{"role": "user", "content": task.prompt}]

    def step(self, action_text):
        from trajgrad.envs import StepResult

        return StepResult([{"role": "user", "content": "go on"}], 0.0, False, False, {})

    def potential(self):
        return 0.0

    def close(self):
        self.closed.append(id(self))


def test_the_collector_closes_each_environment_once_when_it_ends_the_episode(tok):
    from trajgrad.rollout.episodes import EpisodeRunner

    _Endless.closed = []
    envs = []
    make = lambda: envs.append(_Endless()) or envs[-1]  # noqa: E731
    trajs = EpisodeRunner(Scripted(tok, ["more"]), tok).rollout(make, [TASK], group_size=3, seed=0)
    assert [t.truncated for t in trajs] == [True] * 3 and len(trajs[0].turns) == 2
    assert sorted(_Endless.closed) == sorted(id(e) for e in envs)  # each once


@pytest.mark.slow
def test_a_yaml_task_config_with_an_mcp_server_trains(tmp_path):
    from typer.testing import CliRunner

    from trajgrad.cli import app

    pids = tmp_path / "pids"
    pids.mkdir()
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(12)))
    cfg = tmp_path / "mcp.yaml"
    cfg.write_text(f"""
name: mcp-tools
model: {{name: tiny, dtype: float32, lora: null, tiny: {{hidden_size: 32, layers: 1, heads: 2}}}}
task:
  name: dataset
  n_heldout: 1
  options:
    path: {rows}
    reward: {ME}:exact
    max_turns: 2
    tools:
      - mcp: {{command: {sys.executable}, args: [{SERVER}], env: {{MCP_PID_DIR: {pids}, MCP_TOOLS: add}}}}
train: {{steps: 1, prompts_per_step: 1, group_size: 2}}
sft: {{steps: 0}}
eval: {{before: false, after: false}}
sampling: {{max_new_tokens: 4}}
log: {{progress: false}}
checkpoint: {{every: 0}}
""")
    res = CliRunner().invoke(app, ["train", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 1
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("tools/mcp_calls" in l for l in lines)
    # the listing's server, the load-time checks' renderings of the tasks (an environment's reset
    # starts its server), then one per episode (1 prompt x 2 rollouts; an episode that ends before
    # its server has even written its pid stops it all the same): every one stopped
    assert wait_gone(started(pids)) == []
    assert 1 <= len(started(pids)) <= 6


def _episodes_in_this_process(spec, episodes):
    """Each episode calls counter once; (the counts seen, the pids left running after close)."""
    from trajgrad.envs.mcp import close_mcp_servers as close_all

    env = ToolEnv([], lambda text, task: 0.0, mcp=[spec])
    seen = []
    for _ in range(episodes):
        env.reset(TASK)
        seen.append(call(env, "counter").messages[0]["content"])
        env.close()
    close_all()
    return seen, wait_gone(started(spec["env"]["MCP_PID_DIR"]))


@pytest.mark.slow
def test_mcp_tools_in_a_ray_worker(tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    try:
        remote = ray.remote(num_cpus=1)(_episodes_in_this_process)
        seen, left = ray.get(remote.remote(stdio(tmp_path, tools="counter"), 2), timeout=120)
    finally:
        ray.shutdown()
    assert seen == ["1", "1"] and left == []  # one server per episode in the worker too, all stopped
    assert len(started(tmp_path)) == 3
