r"""The episode loop: environments, observation tokens and compaction around an action backend.

:class:`EpisodeRunner` runs many multi-turn episodes at once. Each turn, the token
sequences of the active episodes go to an *action backend* (composition, not
inheritance): :class:`~trajgrad.rollout.generation.HFBackend` samples in process,
:class:`~trajgrad.rollout.openai_backend.OpenAIBackend` asks an OpenAI-compatible server.
The backend returns, per episode, the action's token ids, their behaviour log-probs under
the sampling distribution (§7), whether the action was cut, and (when it knows) the
policy version that sampled it.

Each action ends at the end-of-turn token (kept as its last token) or is cut at
``max_new_tokens`` (``Turn.cut``; the observation then starts with the end-of-turn token
that closes the message, a token the policy did not sample). The action text (without the
end-of-turn token) goes to ``env.step``; the returned messages are appended as observation
tokens: what the model's chat template adds after the sampled tokens
(:class:`~trajgrad.rollout.chat.ChatSession`), never re-tokenized together with the action.
The environment (or the task source) may offer tool schemas for the template's ``tools=``
(``tool_schemas``, :func:`~trajgrad.rollout.chat.tool_schemas_of`). An environment with a
``close()`` method has it called once its episode ends (or the rollout fails): e.g. a
:class:`~trajgrad.envs.toolenv.ToolEnv` stops its episode's MCP servers there.

Template mismatch: when the template renders the conversation so far differently from the
tokens held (:class:`~trajgrad.rollout.chat.TemplateMismatch`: it drops earlier reasoning,
trims whitespace, ...), ``template_mismatch="error"`` raises, ``"truncate"`` ends the
episode there as truncated (``metadata["truncated_by"] == "template_mismatch"``,
``metadata["template_mismatch"]`` True); either way the episode's later tokens are never
trained and :attr:`EpisodeRunner.template_mismatches` counts it.

KV reuse (backends with ``reuse_kv``): the keys and values an episode's context produced
are kept between its turns, so a turn only runs the model on the tokens added since.
Cached states belong to the weights that produced them: they are dropped when the policy
version changes (:meth:`EpisodeRunner.set_policy_version`) and can be dropped by hand with
:meth:`EpisodeRunner.clear_cache` after loading weights in place under the same version.
Episodes on their last allowed turn keep no keys/values.

Partial rollouts (§16): every turn records ``policy_version``: the version the backend
reports for it, else :attr:`EpisodeRunner.policy_version` when it was sampled;
:meth:`set_policy_version` changes it between turns (e.g. after a weight sync).

Compaction (§19): when ``info["compact"]`` holds a summary, the current sub-trace is
closed after that action, and the episode continues in sub-trace ``segment + 1`` whose
prompt is the first system message of the episode, a user message carrying the summary,
then the messages the step returned (same ``episode_id``).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..model.kv import RowKV
from .chat import ChatSession, TemplateMismatch, decode_action, prompt_ids, tool_schemas_of
from .trajectory import Trajectory, Turn

__all__ = ["EpisodeRunner"]


@dataclass
class _Episode:
    task: Any
    group_index: int
    env: Any
    episode_id: str
    system: List[Dict[str, str]]
    prompt: List[int]
    tokens: List[int]
    initial_potential: float
    reset_seconds: float
    segment: int = 0
    turns: List[Turn] = field(default_factory=list)
    closed: List[Trajectory] = field(default_factory=list)
    n_turns: int = 0
    done: bool = False
    success: Optional[bool] = None
    kv: Optional[RowKV] = None  # keys/values of a prefix of ``tokens`` (KV reuse across turns)
    kv_epoch: int = -1
    chat: Optional[ChatSession] = None  # the conversation as messages and as the text its tokens hold
    tools: Optional[List[Dict[str, Any]]] = None
    mismatch: bool = False


def _messages_key(messages) -> Optional[Tuple[Tuple[str, str], ...]]:
    """A hashable key of a chat (role, content pairs), or None if a message has other fields."""
    key = []
    for m in messages:
        if not (isinstance(m, dict) and set(m) <= {"role", "content"}
                and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return None
        key.append((m["role"], m["content"]))
    return tuple(key)


def _may_continue(ep: "_Episode") -> bool:
    """Whether the episode can have a turn after the one being sampled."""
    max_turns = getattr(ep.env, "max_turns", None)
    return max_turns is None or ep.n_turns + 1 < int(max_turns)


def _potential(env) -> float:
    fn = getattr(env, "potential", None)
    if fn is None:
        return 0.0
    return float(fn())


def _close_env(env) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _as_step_result(res) -> Tuple[List[Dict[str, str]], float, bool, bool, Dict[str, Any]]:
    try:
        messages, reward, terminated, truncated, info = res
    except (TypeError, ValueError):
        raise ValueError(
            f"env: step() must return StepResult(messages, reward, terminated, truncated, info), got {res!r}"
        ) from None
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"env: step() returned a non-finite reward {reward}")
    return list(messages or []), reward, bool(terminated), bool(truncated), dict(info or {})


class EpisodeRunner:
    r"""Multi-turn, batched episodes whose actions come from ``backend``.

    Args:
      backend: an action backend: ``settings`` (a
        :class:`~trajgrad.rollout.generation.SamplingSettings`), ``eos_id``, ``device``,
        ``reuse_kv``, ``generate(seqs, generator, *, seeded, past=None, keep_kv=True) ->
        (actions, kvs)``, ``context_limit()``, ``describe()`` and ``eval_mode()``.
      tokenizer: renders prompts and observations (ChatML).
      policy_version: recorded on every turn sampled, unless the backend reports one (§16).
      progress: show a progress bar over episodes.
      max_context_tokens: an episode whose context plus ``max_new_tokens`` would exceed
        this is truncated (default: ``backend.context_limit()``).
      template_mismatch: ``"error"`` (raise) or ``"truncate"`` (end the episode as
        truncated) when the chat template re-renders the history differently from the
        tokens held (``rollout.template_mismatch``).
    """

    def __init__(self, backend, tokenizer, *, policy_version: int = 0, progress: bool = False,
                 max_context_tokens: Optional[int] = None, template_mismatch: str = "error"):
        self.template_mismatch = template_mismatch
        #: episodes whose template re-rendered the history differently (cumulative)
        self.template_mismatches = 0
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_id = backend.eos_id
        self.progress = bool(progress)
        self._max_context_tokens = None if max_context_tokens is None else int(max_context_tokens)
        self._kv_epoch = 0  # bumped whenever cached keys/values become stale
        self.policy_version = 0
        self.set_policy_version(policy_version)

    # the sampling settings, as the backend holds them
    @property
    def temperature(self) -> float:
        return self.backend.settings.temperature

    @property
    def top_k(self) -> Optional[int]:
        return self.backend.settings.top_k

    @property
    def top_p(self) -> Optional[float]:
        return self.backend.settings.top_p

    @property
    def max_new_tokens(self) -> int:
        return self.backend.settings.max_new_tokens

    @property
    def max_context_tokens(self) -> Optional[int]:
        """The episode length limit: the one given, else the backend's context length."""
        if self._max_context_tokens is not None:
            return self._max_context_tokens
        return self.backend.context_limit()

    @property
    def template_mismatch(self) -> str:
        """``"error"`` or ``"truncate"``: what a template that re-renders the history differently does."""
        return self._template_mismatch

    @template_mismatch.setter
    def template_mismatch(self, mode: str) -> None:
        if mode not in ("error", "truncate"):
            raise ValueError(f"template_mismatch: expected 'error' or 'truncate', got {mode!r}")
        self._template_mismatch = mode

    # -------------------------------------------------------------------- settings
    def set_policy_version(self, version: int) -> None:
        """The version recorded on turns sampled from now on (after a weight update)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be a non-negative integer, got {version!r}")
        if version != self.policy_version:
            self.clear_cache()
        self.policy_version = version

    def clear_cache(self) -> None:
        """Drop the keys and values cached for episodes in progress (new weights loaded)."""
        self._kv_epoch += 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling_params(self) -> Dict[str, Any]:
        """What every trajectory records in ``Trajectory.sampling``."""
        described = dict(self.backend.describe())
        params = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "model": described.pop("model", None),
            "greedy": self.greedy,
        }
        params.update(described)
        return params

    def rollout(
        self,
        task_source_or_env_factory: Union[Any, Callable[[], Any]],
        tasks: Sequence[Any],
        *,
        group_size: int = 1,
        seed: Optional[int] = None,
        before_turn: Optional[Callable[[int], None]] = None,
    ) -> List[Trajectory]:
        """Run ``len(tasks) * group_size`` episodes in one batch; return their sub-traces.

        Args:
          task_source_or_env_factory: a ``TaskSource`` (its ``make_env()`` is called) or a
            zero-argument callable returning an ``Environment``; one fresh environment per
            episode.
          tasks: the ``Task`` objects.
          group_size: episodes per task (a group shares ``task_id``).
          seed: seeds the token draws (same seed, same model, same batch: same samples).
          before_turn: optional callback, called with the turn index (0, 1, ...)
            immediately before each batched generation call, i.e. after the environment
            steps of the previous turn. It may load new weights into the model in place
            and call :meth:`set_policy_version`: the turns sampled afterwards record the
            new version and their behaviour log-probs come from the new weights, while the
            earlier turns keep theirs (partial rollouts, §16).

        Returns:
          the trajectories ordered by task, then group member, then segment. Every
          trajectory of an episode carries the episode's final ``success``;
          ``metadata`` holds ``group_index``, ``env``, ``initial_potential``,
          ``episode_reward`` (summed over segments), ``num_segments``, ``compacted``.
        """
        make_env = getattr(task_source_or_env_factory, "make_env", None)
        if make_env is None:
            if not callable(task_source_or_env_factory):
                raise ValueError(
                    "task_source_or_env_factory: expected a TaskSource (with make_env) or a callable returning an Environment"
                )
            make_env = task_source_or_env_factory
        tasks = list(tasks)
        if not tasks:
            raise ValueError("tasks: empty; nothing to roll out")
        for task in tasks:
            if not hasattr(task, "id") or not hasattr(task, "split"):
                raise ValueError(f"tasks: expected Task objects, got {type(task).__name__}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: must be a positive integer, got {group_size!r}")
        if before_turn is not None and not callable(before_turn):
            raise ValueError(f"before_turn: expected a callable taking the turn index, got {type(before_turn).__name__}")

        max_context = self.max_context_tokens
        backend = self.backend
        generator = torch.Generator(device=backend.device)
        if seed is not None:
            generator.manual_seed(int(seed))
        else:
            generator.seed()
        sampling = dict(self.sampling_params(), seed=seed)
        # the episodes' id suffix: a function of the seed for a seeded call (the same seed gives
        # the same trajectories, ids included; the trainer's calls each have their own seed), random otherwise
        run = hashlib.sha256(f"seed:{int(seed)}".encode()).hexdigest()[:10] if seed is not None else uuid.uuid4().hex[:10]

        episodes: List[_Episode] = []
        try:
            return self._rollout(make_env, task_source_or_env_factory, tasks, group_size, episodes, generator,
                                 seed, sampling, run, max_context, before_turn)
        finally:  # an error ends every episode still open (their environments are closed)
            for ep in episodes:
                if not ep.done:
                    ep.done = True
                    _close_env(ep.env)

    def _rollout(self, make_env, task_source_or_env_factory, tasks, group_size, episodes, generator, seed, sampling,
                 run, max_context, before_turn) -> List[Trajectory]:
        backend = self.backend
        encoded: Dict[Any, ChatSession] = {}  # a group's members share a prompt
        source = task_source_or_env_factory if hasattr(task_source_or_env_factory, "make_env") else None
        for task in tasks:
            for g in range(group_size):
                env = make_env()
                try:  # until the episode is listed, this loop closes its environment on an error
                    t0 = time.perf_counter()
                    messages = list(env.reset(task))
                    reset_s = time.perf_counter() - t0
                    tools = tool_schemas_of(env, source)
                    key = _messages_key(messages)
                    if key is not None:
                        key = (key, None if tools is None else json.dumps(tools, sort_keys=True))
                    if key is None or key not in encoded:
                        ids = prompt_ids(self.tokenizer, messages, tools)
                        chat = ChatSession(self.tokenizer, messages, tools=tools, prompt=ids)
                        if key is not None:
                            encoded[key] = chat
                    else:
                        chat = copy.copy(encoded[key])
                    ids = list(chat.prompt_ids)
                    self._check_fits(ids, task, max_context)
                    system = [m for m in messages[:1] if m.get("role") == "system"]
                    episodes.append(
                        _Episode(
                            task=task, group_index=g, env=env, episode_id=f"{task.id}#{g}-{run}", system=system,
                            prompt=ids, tokens=list(ids), initial_potential=_potential(env), reset_seconds=reset_s,
                            chat=chat, tools=tools,
                        )
                    )
                except BaseException:
                    _close_env(env)
                    raise

        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(episodes), desc="rollout", unit="episode", leave=False)
        try:
            with backend.eval_mode():
                self._run(episodes, generator, seed is not None, sampling, max_context, before_turn, bar)
        finally:
            if bar is not None:
                bar.close()

        out: List[Trajectory] = []
        for ep in episodes:
            total = float(sum(t.total_reward for t in ep.closed))
            for tr in ep.closed:
                tr.success = ep.success
                tr.metadata["episode_reward"] = total
                tr.metadata["num_segments"] = len(ep.closed)
            out.extend(ep.closed)
        return out

    def _run(self, episodes, generator, seeded: bool, sampling, max_context, before_turn, bar) -> None:
        """Turns until every episode has ended."""
        backend = self.backend
        active = list(episodes)
        turn = 0
        while active:
            for ep in active:
                if max_context is not None and len(ep.tokens) + self.max_new_tokens > max_context:
                    self._close(ep, terminated=False, truncated=True, sampling=sampling, reason="context")
            active = [ep for ep in active if not ep.done]
            if not active:
                break
            if before_turn is not None:
                before_turn(turn)
            turn += 1
            version = self.policy_version
            epoch = self._kv_epoch
            t0 = time.perf_counter()
            seqs = [ep.tokens for ep in active]
            if backend.reuse_kv:
                past = [ep.kv if ep.kv is not None and ep.kv_epoch == epoch else None for ep in active]
                # an episode on its last allowed turn ends after it: its keys/values are not kept
                keep = any(_may_continue(ep) for ep in active)
                actions, kvs = backend.generate(seqs, generator, seeded=seeded, past=past, keep_kv=keep)
            else:
                actions, kvs = backend.generate(seqs, generator, seeded=seeded)
            gen_s = time.perf_counter() - t0
            for ep, action, kv in zip(active, actions, kvs):
                ep.kv, ep.kv_epoch = kv, epoch
                v = version if action.policy_version is None else int(action.policy_version)
                self._advance(ep, action.ids, action.logp, action.cut, v, gen_s, sampling)
                if ep.done and bar is not None:
                    bar.update(1)
            active = [ep for ep in active if not ep.done]
            if bar is not None:
                bar.set_postfix(active=len(active))

    # -------------------------------------------------------------------- episode logic
    def _check_fits(self, ids: List[int], task, max_context: Optional[int]) -> None:
        if max_context is not None and len(ids) + self.max_new_tokens > max_context:
            raise ValueError(
                f"tasks: the prompt of task {task.id!r} has {len(ids)} tokens; with max_new_tokens="
                f"{self.max_new_tokens} it exceeds max_context_tokens={max_context}"
            )

    def _advance(self, ep: _Episode, action, logp, cut, version, gen_s, sampling) -> None:
        text = decode_action(self.tokenizer, action, self.eos_id)
        t0 = time.perf_counter()
        messages, reward, terminated, truncated, info = _as_step_result(ep.env.step(text))
        env_s = time.perf_counter() - t0
        ep.n_turns += 1
        max_turns = getattr(ep.env, "max_turns", None)
        if not (terminated or truncated) and max_turns is not None and ep.n_turns >= int(max_turns):
            truncated = True
            info.setdefault("truncated_by", "max_turns")
        done = terminated or truncated
        summary = info.get("compact") if not done else None
        obs: List[int] = []
        if not (done or summary is not None):
            try:
                obs = ep.chat.observe(action, text, messages)
            except TemplateMismatch as exc:
                self.template_mismatches += 1
                if self.template_mismatch == "error":
                    raise TemplateMismatch(
                        f"template_mismatch (rollout.template_mismatch): episode {ep.episode_id!r}, turn "
                        f"{ep.n_turns}: {exc}; set it to 'truncate' to end such episodes as truncated instead"
                    ) from None
                truncated = done = True
                ep.mismatch = True
                info["truncated_by"] = "template_mismatch"
        ep.turns.append(
            Turn(
                action_ids=action, observation_ids=obs, behaviour_logp=logp, policy_version=version,
                reward=reward, info=info, action_text=text, cut=cut, gen_seconds=gen_s, env_seconds=env_s,
            )
        )
        ep.tokens.extend(action)
        ep.tokens.extend(obs)
        if "success" in info and info["success"] is not None:
            ep.success = bool(info["success"])
        if done:
            self._close(ep, terminated=terminated, truncated=truncated, sampling=sampling)
        elif summary is not None:
            self._close_segment(ep, sampling, compacted=True)
            context = ep.system + [{"role": "user", "content": str(summary)}] + messages
            ep.segment += 1
            ep.chat = ChatSession(self.tokenizer, context, tools=ep.tools)
            ep.prompt = list(ep.chat.prompt_ids)
            self._check_fits(ep.prompt, ep.task, self.max_context_tokens)
            ep.tokens = list(ep.prompt)
            ep.kv = None
            ep.initial_potential = _potential(ep.env)

    def _close_segment(self, ep: _Episode, sampling, *, terminated=False, truncated=False, compacted=False) -> None:
        task = ep.task
        ep.closed.append(
            Trajectory(
                task_id=task.id, episode_id=ep.episode_id, segment=ep.segment, split=task.split,
                prompt_ids=ep.prompt, turns=ep.turns, terminated=terminated, truncated=truncated,
                sampling=dict(sampling),
                metadata={
                    "group_index": ep.group_index,
                    "env": getattr(ep.env, "name", type(ep.env).__name__),
                    "initial_potential": ep.initial_potential,
                    "reset_seconds": ep.reset_seconds if ep.segment == 0 else 0.0,
                    "compacted": compacted,
                    **({"template_mismatch": True, "truncated_by": "template_mismatch"} if ep.mismatch else {}),
                },
            )
        )
        ep.turns = []

    def _close(self, ep: _Episode, *, terminated: bool, truncated: bool, sampling, reason: str = "") -> None:
        ep.done = True
        _close_env(ep.env)
        ep.kv = None
        if reason == "context" and ep.turns:
            # nothing was generated after the last observation: drop it, so that the
            # trajectory itself fits in the context window
            last = ep.turns[-1]
            del ep.tokens[len(ep.tokens) - len(last.observation_ids):]
            last.observation_ids = []
        if ep.turns:
            self._close_segment(ep, sampling, terminated=terminated, truncated=truncated)
        elif ep.closed:  # nothing sampled in the new segment: the previous one ends the episode
            ep.closed[-1].truncated = ep.closed[-1].truncated or truncated
            ep.closed[-1].terminated = ep.closed[-1].terminated or terminated
        if reason and ep.closed:
            ep.closed[-1].metadata["truncated_by"] = reason
