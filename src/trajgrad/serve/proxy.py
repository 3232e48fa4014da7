r"""``rollout.backend: proxy``: train an agent that speaks the OpenAI chat API, unchanged.

:class:`ProxySampler` stands where the in-process sampler stands in the trainer
(``rollout(source, tasks, group_size=G, seed=...)`` returns
:class:`~trajgrad.rollout.trajectory.Trajectory` records). Instead of driving an environment
it serves the trainer's **live** policy on loopback (``trajgrad serve``'s app, in this
process, sharing the model object: after each update the served weights are the updated
ones and the reported ``policy_version`` is the trainer's, §16) and runs the user's agent
once per episode:

* a **shell command** (``rollout.proxy.agent: "python my_agent.py"``), with
  ``OPENAI_BASE_URL=http://127.0.0.1:PORT/s/<session>/v1`` (the session is in the URL, so
  ``openai.OpenAI()`` records every call under it unchanged: chat completions and
  responses), ``ANTHROPIC_BASE_URL=http://127.0.0.1:PORT/s/<session>`` (``anthropic.Anthropic()``
  appends ``/v1/messages``), ``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``,
  ``TRAJGRAD_SESSION``, ``TRAJGRAD_REWARD_URL``, ``TRAJGRAD_MODEL``, ``TRAJGRAD_TASK_ID``,
  ``TRAJGRAD_SPLIT`` and ``TRAJGRAD_TASK`` (the task as JSON: ``id``, ``split``,
  ``prompt``, ``answer``, ``metadata``), the trainer's Python first on ``PATH`` (``python``
  is the interpreter that trains);
* or a **Python callable** ``"package.module:function"``, called in a thread with the
  keyword arguments it names among ``task`` (the :class:`~trajgrad.envs.base.Task`),
  ``base_url`` (``.../s/<session>/v1``, an OpenAI client's), ``anthropic_base_url``
  (``.../s/<session>``, an Anthropic client's), ``session``, ``model``, ``api_key``; returning
  a number (the reward), a dict ``{"reward", "success"}`` or None (it reported the reward itself).

The reward ends the episode (``POST /v1/trajgrad/episodes/{session}/reward``, e.g.
:func:`trajgrad.serve.client.report_reward`). ``G`` episodes per task
(``group_size`` of a grouped recipe; one for SAO, PPO, ...) run up to
``rollout.proxy.concurrency`` at a time; their concurrent chat calls are batched by the
server. An episode without a reward after ``rollout.proxy.reward_timeout_s`` is expired
(its process killed; later calls answered 410): **counted, never trained**. So is an episode
whose client rewrote its history, or whose chat template re-rendered it differently
(:mod:`trajgrad.serve.sessions`: divergences). The learner recomputes under the run's
``sampling.*``; the server samples every chat call with exactly those settings and answers a
call that asks for others with 400 naming the field.

The counts are in :attr:`ProxySampler.counters` (cumulative) and :meth:`ProxySampler.step_stats`.
A shell agent's output (stdout and stderr) is kept in the run directory's ``agent_output.log``,
one block per episode; the first agent that exits non-zero or without reporting a reward is
also printed with the end of its output.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..rollout.chat import end_of_turn_id
from ..rollout.trajectory import Trajectory
from .app import create_app
from .loopback import LoopbackServer
from .sessions import Sessions

__all__ = ["ProxySampler", "build_proxy_sampler", "check_proxy_config", "is_callable_spec", "load_agent"]

_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_ARGS = ("task", "base_url", "anthropic_base_url", "session", "model", "api_key")
API_KEY = "trajgrad-local"


def is_callable_spec(agent: str) -> bool:
    """Whether ``rollout.proxy.agent`` names a Python callable (``package.module:function``)."""
    return bool(_CALLABLE.match(agent.strip()))


def load_agent(agent: str, key: str = "rollout.proxy.agent") -> Callable:
    """The callable named ``package.module:function``; ValueError naming ``key`` otherwise."""
    mod_name, _, fn_name = agent.strip().partition(":")
    try:
        mod = import_module(mod_name)
    except Exception as exc:  # ImportError, or the module failed while importing
        raise ValueError(f"{key}: cannot import {mod_name!r} ({type(exc).__name__}: {exc})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{key}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def _task_json(task) -> str:
    d = dataclasses.asdict(task) if dataclasses.is_dataclass(task) else {"id": task.id, "split": task.split}
    return json.dumps(d, default=str)


def _outcome(value) -> Optional[Dict[str, Any]]:
    """A callable's return value as ``{"reward", "success"}`` (None: it reported itself)."""
    if value is None:
        return None
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"agent: a returned dict needs a 'reward' key, got {sorted(value)}")
        return {"reward": value["reward"], "success": value.get("success")}
    return {"reward": value, "success": None}


class ProxySampler:
    """Serve the live policy on loopback and run the agent per episode (see the module doc).

    Args:
      model, tokenizer: the trainer's policy (shared, not copied) and its tokenizer.
      agent: a shell command or ``package.module:function``.
      temperature, top_k, top_p: the sampling distribution of every chat call (the
        learner's: §7).
      max_new_tokens: ``max_tokens`` of a call that gives none.
      policy_version: the version reported until :meth:`set_policy_version`.
      reward_timeout_s: how long an episode may run before it is expired.
      concurrency: episodes run at once.
      model_name: the id the server reports (``TRAJGRAD_MODEL``).
      accept_any_model: answer calls naming any model (agents often hard-code a model name).
      console: where warnings (an agent that fails) are printed.
      output_log: a file that keeps every shell-command episode's output (stdout and stderr,
        after a header naming the session, the task and the exit status); a run writes
        ``agent_output.log`` in its directory. None: kept only to show on a failure.
    """

    def __init__(self, model, tokenizer, *, agent: str, temperature: float, top_k: Optional[int],
                 top_p: Optional[float], max_new_tokens: int, policy_version: int = 0,
                 reward_timeout_s: float = 300.0, concurrency: int = 8, model_name: str = "trajgrad-policy",
                 accept_any_model: bool = True, console: Callable[[str], None] = print,
                 output_log: Optional[str] = None, engine=None):
        if not isinstance(agent, str) or not agent.strip():
            raise ValueError("rollout.proxy.agent: expected a shell command or 'package.module:function'")
        if not (isinstance(reward_timeout_s, (int, float)) and math.isfinite(reward_timeout_s) and reward_timeout_s > 0):
            raise ValueError(f"rollout.proxy.reward_timeout_s: must be a positive number, got {reward_timeout_s!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"rollout.proxy.concurrency: must be a positive integer, got {concurrency!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.agent = agent.strip()
        self._fn = load_agent(self.agent) if is_callable_spec(self.agent) else None
        self.reward_timeout_s = float(reward_timeout_s)
        self.concurrency = concurrency
        self.max_new_tokens = int(max_new_tokens)
        self.model_name = model_name
        self.accept_any_model = accept_any_model
        self.console = console
        self.output_log, self._log_lock = output_log, threading.Lock()
        self.template_mismatch = "truncate"  # divergences are always counted and never trained
        was_training = model.training
        self.sessions = Sessions(tokenizer, end_of_turn_id(tokenizer), strict=True)
        self.fixed = {"temperature": float(temperature), "top_k": top_k, "top_p": top_p}
        self.app = create_app(model, tokenizer, model_name=model_name, policy_version=policy_version,
                              sessions=self.sessions, fixed_sampling=self.fixed,
                              chat_max_tokens=self.max_new_tokens, max_tokens_limit=max(4096, self.max_new_tokens),
                              accept_any_model=accept_any_model)
        model.train(was_training)
        self.state = self.app.state.trajgrad
        self.state.engine = self.engine = engine  # a VLLMEngine: calls sampled by vLLM (trajgrad.serve.vllm_engine)
        self.server = None
        self.counters: Dict[str, int] = {"episodes": 0, "trained": 0, "timeouts": 0, "diverged": 0, "empty": 0,
                                         "agent_errors": 0}
        self._step: Dict[str, int] = dict.fromkeys(self.counters, 0)
        self._warned = False

    # -------------------------------------------------------------- trainer interface
    @property
    def policy_version(self) -> int:
        return self.state.policy_version

    def set_policy_version(self, version: int) -> None:
        """The version reported (and recorded on turns) from now on; the weights are shared."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be a non-negative integer, got {version!r}")
        if self.engine is not None and version != self.state.policy_version:
            self.engine.sync(self.model, version)  # the server samples the new weights from now on
        with self.state.lock:
            self.state.policy_version = version

    def sampling_params(self) -> Dict[str, Any]:
        return {**self.fixed, "max_new_tokens": self.max_new_tokens, "model": self.model_name, "backend": "proxy"}

    @property
    def url(self) -> str:
        return self._serve().url

    def _serve(self):
        if self.server is None:
            self.server = LoopbackServer(self.app).start()
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.engine is not None:
            self.engine.close()

    def step_stats(self) -> Dict[str, float]:
        """Counts of the last :meth:`rollout` (``proxy/timeouts``, ``proxy/diverged``, ...), and a vLLM
        engine's ``sync/*``."""
        out = {f"proxy/{k}": float(v) for k, v in self._step.items()}
        if self.engine is not None:
            out.update(self.engine.step_stats())
        return out

    def rollout(self, source, tasks: Sequence[Any], *, group_size: int = 1, seed: Optional[int] = None,
                before_turn=None) -> List[Trajectory]:
        """Run the agent ``group_size`` times per task; the episodes that ended with a reward.

        Expired (timed-out), diverged and empty episodes are counted in :attr:`counters`
        and left out. Trajectories are ordered by task, then group member.
        """
        if before_turn is not None:
            raise ValueError("before_turn: the proxy cannot pause an external agent between turns")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: must be a positive integer, got {group_size!r}")
        return self._run(list(tasks), group_size, seed)

    def evaluate(self, tasks: Sequence[Any], *, temperature: float = 0.0, seed: Optional[int] = 0) -> List[Trajectory]:
        """One episode per task at ``temperature`` (held-out success: ``trajectory.success``).

        The sampling settings are restored afterwards.
        """
        saved = dict(self.fixed)
        self.fixed.update(temperature=float(temperature), top_k=None, top_p=None)
        try:
            return self._run(list(tasks), 1, seed, count=False)
        finally:
            self.fixed.update(saved)

    # -------------------------------------------------------------- episodes
    def _run(self, tasks: List[Any], group_size: int, seed: Optional[int], count: bool = True) -> List[Trajectory]:
        srv = self._serve()
        if seed is not None:
            self.state.generator.manual_seed(int(seed))
        run = uuid.uuid4().hex[:8]
        jobs = []
        for t_index, task in enumerate(tasks):
            for g in range(group_size):
                sid = f"{run}-{t_index}-{g}"
                self.sessions.open(sid, task_id=str(task.id), split=getattr(task, "split", "train"), group_index=g)
                jobs.append((sid, task))
        was_training = self.model.training
        step = dict.fromkeys(self.counters, 0)
        try:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(jobs)) or 1) as pool:
                outcomes = list(pool.map(lambda job: self._episode(srv.url, *job), jobs))
        finally:
            self.model.train(was_training)
        out = []
        for (sid, _task), kind in zip(jobs, outcomes):
            s = self.sessions.pop(sid)
            step["episodes"] += 1
            if kind == "agent_error":
                step["agent_errors"] += 1
            if s.status == "expired":
                step["timeouts"] += 1
            elif s.trajectory is None:
                step["diverged" if s.diverged else "empty"] += 1
            elif s.diverged is not None:
                step["diverged"] += 1
            else:
                step["trained"] += 1
                out.append(s.trajectory)
        if count:
            self._step = step
            for k, v in step.items():
                self.counters[k] += v
        return out

    def _episode(self, url: str, sid: str, task) -> str:
        """Run one agent episode to its reward or its deadline; ``"ok"`` or ``"agent_error"``."""
        deadline = time.monotonic() + self.reward_timeout_s
        base = f"{url}/s/{sid}/v1"
        kind = "ok"
        try:
            if self._fn is not None:
                kind = self._call(base, sid, task, deadline)
            else:
                kind = self._command(url, base, sid, task, deadline)
        finally:
            left = self.sessions.wait_finished([sid], min(deadline, time.monotonic() + 1.0))
            if left:
                self.sessions.expire(sid)
        return kind

    def _warn(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            self.console(f"rollout.proxy.agent: {msg} (further agent failures are only counted: proxy/agent_errors)")

    def _finish_with(self, sid: str, outcome: Optional[Dict[str, Any]]) -> None:
        if outcome is None:
            return
        reward = outcome["reward"]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
            raise ValueError(f"agent: the reward must be a finite number, got {reward!r}")
        s = self.sessions.get(sid)
        if s.status == "open":
            success = outcome.get("success")
            self.sessions.finish(sid, float(reward), success=None if success is None else bool(success))

    def _call(self, base: str, sid: str, task, deadline: float) -> str:
        params = inspect.signature(self._fn).parameters
        accepts_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
        values = {"task": task, "base_url": base, "anthropic_base_url": base[:-len("/v1")], "session": sid,
                  "model": self.model_name, "api_key": API_KEY}
        kwargs = {k: v for k, v in values.items() if accepts_all or k in params}
        box: Dict[str, Any] = {}

        def target():
            try:
                box["value"] = self._fn(**kwargs)
            except BaseException as exc:  # reported below, never raised into the trainer
                box["error"] = exc

        th = threading.Thread(target=target, daemon=True, name=f"trajgrad-agent-{sid}")
        th.start()
        th.join(timeout=max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            return "ok"  # still running at the deadline: expired by the caller
        if "error" in box:
            exc = box["error"]
            self._warn(f"{self.agent} raised {type(exc).__name__}: {exc}")
            return "agent_error"
        try:
            self._finish_with(sid, _outcome(box.get("value")))
        except ValueError as exc:
            self._warn(str(exc))
            return "agent_error"
        return "ok"

    def _command(self, url: str, base: str, sid: str, task, deadline: float) -> str:
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        env = dict(os.environ, PATH=path, OPENAI_BASE_URL=base, OPENAI_API_KEY=API_KEY,
                   ANTHROPIC_BASE_URL=f"{url}/s/{sid}", ANTHROPIC_API_KEY=API_KEY, TRAJGRAD_SESSION=sid,
                   TRAJGRAD_REWARD_URL=f"{url}/v1/trajgrad/episodes/{sid}/reward", TRAJGRAD_MODEL=self.model_name,
                   TRAJGRAD_TASK_ID=str(task.id), TRAJGRAD_SPLIT=str(getattr(task, "split", "train")),
                   TRAJGRAD_TASK=_task_json(task))
        proc = subprocess.Popen(self.agent, shell=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the agent's own process group
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
            self._keep_output(sid, task, "killed at rollout.proxy.reward_timeout_s", out)
            return "ok"
        text = self._keep_output(sid, task, f"exit status {proc.returncode}", out)
        where = f" (all its output: {self.output_log})" if self.output_log else ""
        if proc.returncode != 0:
            self._warn(f"`{self.agent}` exited with status {proc.returncode}: {text[-500:].strip()}{where}")
            return "agent_error"
        if self.sessions.get(sid).status == "open":  # ended without a reward: counted as empty
            self._warn(f"`{self.agent}` exited without reporting a reward: {text[-500:].strip()}{where}")
        return "ok"

    def _keep_output(self, sid: str, task, status: str, out: Optional[bytes]) -> str:
        """The agent's output as text, appended to :attr:`output_log` under a header line."""
        text = (out or b"").decode(errors="replace")
        if self.output_log:
            with self._log_lock, open(self.output_log, "a") as fh:
                end = "" if text.endswith("\n") else "\n"
                fh.write(f"=== session {sid} task {task.id} ({status}) ===\n{text}{end}")
        return text

    def __repr__(self) -> str:
        return f"ProxySampler(agent={shlex.quote(self.agent)}, url={self.server.url if self.server else None})"


def check_proxy_config(cfg, add: Callable[[str, str], None]) -> None:
    """Load-time checks of ``rollout.backend: proxy`` (``add(dotted_key, message)`` per problem)."""
    p = cfg.rollout.proxy
    if p.agent is None or not p.agent.strip():
        add("rollout.proxy.agent", "required for rollout.backend 'proxy': a shell command (e.g. 'python agent.py') "
                                   "or 'package.module:function'")
    elif is_callable_spec(p.agent):
        try:
            load_agent(p.agent)
        except ValueError as exc:
            add("rollout.proxy.agent", str(exc).split(": ", 1)[1])
    if cfg.asynchronous.enabled:
        add("asynchronous.enabled", "rollout.backend 'proxy' runs with the synchronous trainer; set it to false")
    if cfg.dist.fsdp:
        add("dist.fsdp", "rollout.backend 'proxy' serves the policy in one process; FSDP sharding is not supported")
    if cfg.sampling.behaviour_temperature is not None:
        add("sampling.behaviour_temperature", "not supported with rollout.backend 'proxy' (the agent's calls are "
                                              "sampled at sampling.temperature)")


def build_proxy_sampler(cfg, model, tokenizer, policy_version: int = 0, run_dir=None, engine=None) -> ProxySampler:
    """The :class:`ProxySampler` of a run (``rollout.proxy.*``, ``sampling.*``); the agent's
    output is kept in ``run_dir/agent_output.log``. ``engine``: a
    :class:`~trajgrad.serve.vllm_engine.VLLMEngine` that draws the samples
    (``rollout.proxy.engine: vllm``; the trainer's setup starts it), else the served policy does."""
    s, p = cfg.sampling, cfg.rollout.proxy
    name = cfg.model.path if cfg.model.path is not None else f"trajgrad-{cfg.model.name}"
    return ProxySampler(model, tokenizer, agent=p.agent, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                        max_new_tokens=s.max_new_tokens, policy_version=policy_version,
                        reward_timeout_s=p.reward_timeout_s, concurrency=p.concurrency, model_name=name,
                        output_log=None if run_dir is None else os.path.join(str(run_dir), "agent_output.log"),
                        engine=engine)
