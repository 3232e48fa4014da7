r"""Episodes recorded through ``/v1/chat/completions``: token in / token out, one session per episode.

A session id (the ``X-Trajgrad-Session`` header, the ``/s/{session}/v1`` base-URL prefix, or
the request's ``user`` field) groups the chat calls of one episode. The server keeps the
token sequence of the episode itself and never re-tokenizes what it sampled:

* the first call's messages are rendered with the chat template (with the request's
  ``tools``): the prompt tokens :math:`p`;
* a later call must repeat the conversation the session holds, then one assistant message
  that is one of the choices served for the previous call (matched by its tool-call ids and
  arguments, or its text), then new messages. The previous turn's sampled tokens
  :math:`a_k` are kept verbatim, and the observation tokens :math:`o_k` are what the
  template adds after them (:meth:`trajgrad.rollout.chat.ChatSession.observe`, with its
  prefix check), so the new prompt is :math:`p + a_0 + o_0 + \dots + a_k + o_k`: it extends
  the previous turn's prompt plus sampled tokens by construction.

A call that does not extend the session (the client rewrote or dropped earlier messages,
changed the tools, or sent an assistant message the server did not sample) and a template
that renders the held history differently (:class:`~trajgrad.rollout.chat.TemplateMismatch`)
are **divergences**: counted, the session marked (``metadata["diverged"]``), and from then
on the session is only served (rendered afresh), not recorded further. Nothing is merged.

``POST /v1/trajgrad/episodes/{id}/reward`` ends the episode: its turns become a
:class:`~trajgrad.rollout.trajectory.Trajectory` (§4: only sampled tokens carry
``action_mask = 1``; observation tokens are masked), with each turn's behaviour
log-probs as served and the policy version that sampled it (§16); the reward is the last
turn's reward.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..rollout.chat import ChatSession, TemplateMismatch
from ..rollout.trajectory import Trajectory, Turn
from .chat_requests import ChatPlan, rendered
from .errors import RequestError

__all__ = ["Candidate", "Session", "Sessions"]


@dataclass
class Candidate:
    """One choice served for a session's pending call."""

    action_ids: List[int]
    logp: List[float]
    cut: bool
    version: int
    text: str  # the sampled tokens decoded verbatim, without the end-of-turn token
    content: str  # the message content served (text outside the tool calls)
    tool_calls: List[Dict[str, Any]]  # [{"id", "name", "arguments": dict}]
    sampling: Dict[str, Any]

    def matches(self, message: Dict[str, Any]) -> bool:
        """Whether the client's assistant ``message`` (normalized) is this choice."""
        if message.get("role") != "assistant":
            return False
        calls = message.get("tool_calls") or []
        if self.tool_calls:
            if len(calls) != len(self.tool_calls):
                return False
            for got, served in zip(calls, self.tool_calls):
                if got["name"] != served["name"] or got["arguments"] != served["arguments"]:
                    return False
                if got.get("id") is not None and got["id"] != served["id"]:
                    return False
            # clients often drop the text that came with the calls; the calls identify the choice
            return message["content"] in ("", self.content, self.text)
        return not calls and message["content"] in (self.content, self.text)


@dataclass
class Session:
    id: str
    task_id: str
    split: str = "train"
    group_index: int = 0
    metadata: Dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    calls: Any = field(default=None, repr=False)  # an asyncio.Lock: one call of a session at a time
    chat: Optional[ChatSession] = None
    client_messages: List[Dict[str, Any]] = field(default_factory=list)
    tools: Optional[List[Dict[str, Any]]] = None
    prompt_ids: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    turns: List[Turn] = field(default_factory=list)
    candidates: List[Candidate] = field(default_factory=list)
    served: List[Candidate] = field(default_factory=list)  # every choice served (for fresh renders)
    last_request: int = 0  # index into candidates where the last call's choices start
    diverged: Optional[str] = None
    status: str = "open"  # open | finished | expired
    requests: int = 0
    trajectory: Optional[Trajectory] = None


class Sessions:
    """The sessions of one server: open, extend (with the prefix check), finish, expire.

    Args:
      tokenizer: the served tokenizer (its chat template renders the conversations).
      eos_id: the end-of-turn token that closes a sampled action.
      strict: refuse calls for sessions not opened with :meth:`open` (a trainer's server:
        an expired or unknown episode must not start a new one); otherwise a new id opens a
        session with ``task_id`` equal to the id.
      max_sessions: most sessions kept; past it an ended one is dropped first, else the least
        recently active open one is expired (counted).
    """

    def __init__(self, tokenizer, eos_id: int, *, strict: bool = False, max_sessions: int = 10000):
        self.tokenizer = tokenizer
        self.eos_id = int(eos_id)
        self.strict = bool(strict)
        self.max_sessions = int(max_sessions)
        self._lock = threading.Lock()
        self._sessions: Dict[str, Session] = {}
        self._ended: "OrderedDict[str, str]" = OrderedDict()  # removed sessions -> status (bounded)
        self.counters: Dict[str, int] = {"sessions": 0, "requests": 0, "finished": 0, "diverged": 0,
                                         "template_mismatch": 0, "expired": 0, "empty": 0}
        self._finished = threading.Condition(self._lock)

    # ------------------------------------------------------------------ registry
    def open(self, session_id: str, *, task_id: Optional[str] = None, split: str = "train", group_index: int = 0,
             metadata: Optional[Dict[str, Any]] = None) -> Session:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id: expected a non-empty string, got {session_id!r}")
        with self._lock:
            if session_id in self._sessions or session_id in self._ended:
                raise ValueError(f"session_id: {session_id!r} is already in use")
            s = Session(id=session_id, task_id=task_id or session_id, split=split, group_index=int(group_index),
                        metadata=dict(metadata or {}))
            self._sessions[session_id] = s
            self.counters["sessions"] += 1
            if len(self._sessions) > self.max_sessions:
                others = [x for x in self._sessions.values() if x.id != session_id]
                oldest = min(others, key=lambda x: (x.status == "open", x.last_active))  # ended ones first
                if oldest.status == "open":
                    oldest.status = "expired"
                    self.counters["expired"] += 1
                del self._sessions[oldest.id]
                self._ended[oldest.id] = oldest.status
                while len(self._ended) > self.max_sessions:
                    self._ended.popitem(last=False)
            return s

    def get(self, session_id: str, *, create: bool = False) -> Session:
        with self._lock:
            s = self._sessions.get(session_id)
            ended = self._ended.get(session_id)
        if s is None and ended is not None:
            raise RequestError(f"session: episode {session_id!r} is {ended}; start a new session", param="session",
                               status=410)
        if s is None:
            if create and not self.strict:
                return self.open(session_id)
            raise RequestError(f"session: unknown episode {session_id!r}", param="session", status=404)
        return s

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            out["open"] = sum(1 for s in self._sessions.values() if s.status == "open")
            return out

    # ------------------------------------------------------------------ one call
    def prepare(self, s: Session, plan: ChatPlan) -> List[int]:
        """The prompt tokens of this call; extends (and records) the session, or marks a divergence."""
        with s.lock:
            if s.status != "open":
                raise RequestError(f"session: episode {s.id!r} is {s.status}; start a new session",
                                   param="session", status=410)
            s.requests += 1
            s.last_active = time.time()
            with self._lock:
                self.counters["requests"] += 1
            if s.chat is None:
                return self._start(s, plan)
            if s.diverged is not None:
                return self._fresh(s, plan)
            if plan.messages == s.client_messages and plan.tools == s.tools:
                s.last_request = len(s.candidates)
                return list(s.tokens)  # the same call again (a retry, more samples): same prompt
            reason = self._extend(s, plan)
            if reason is None:
                return list(s.tokens)
            s.diverged = reason
            with self._lock:
                self.counters["diverged"] += 1
                if reason.startswith("template"):
                    self.counters["template_mismatch"] += 1
            return self._fresh(s, plan)

    def _render(self, s: Session, messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        out = []
        for m in messages:
            hit = next((c for c in s.served if c.matches(m)), None) if m["role"] == "assistant" else None
            out.append({"role": "assistant", "content": hit.text} if hit is not None else rendered(m))
        return out

    def _session_for(self, s: Session, plan: ChatPlan) -> ChatSession:
        try:
            return ChatSession(self.tokenizer, self._render(s, plan.messages), tools=plan.tools)
        except ValueError as exc:
            raise RequestError(str(exc), param="tools" if str(exc).startswith("tools") else "messages") from None

    def _start(self, s: Session, plan: ChatPlan) -> List[int]:
        s.chat = self._session_for(s, plan)
        s.client_messages = list(plan.messages)
        s.tools = plan.tools
        s.prompt_ids = list(s.chat.prompt_ids)
        s.tokens = list(s.prompt_ids)
        s.last_request = 0
        return list(s.tokens)

    def _fresh(self, s: Session, plan: ChatPlan) -> List[int]:
        return list(self._session_for(s, plan).prompt_ids)

    def _extend(self, s: Session, plan: ChatPlan) -> Optional[str]:
        """Append the previous turn and its observation; the divergence reason, or None."""
        held = s.client_messages
        msgs = plan.messages
        if plan.tools != s.tools:
            return "tools: the tools differ from the episode's first call"
        if len(msgs) <= len(held) or msgs[:len(held)] != held:
            at = next((i for i, (a, b) in enumerate(zip(msgs, held)) if a != b), min(len(msgs), len(held)))
            return f"history: message {at} differs from the conversation the episode holds"
        reply = msgs[len(held)]
        hit = next((c for c in reversed(s.candidates) if c.matches(reply)), None)
        if hit is None:
            return f"history: message {len(held)} is not a reply this server sampled for the episode"
        new = [rendered(m) for m in msgs[len(held) + 1:]]
        try:
            obs = s.chat.observe(hit.action_ids, hit.text, new)
        except TemplateMismatch as exc:
            return f"template: {exc}"
        except ValueError as exc:
            raise RequestError(str(exc), param="messages") from None
        s.turns.append(Turn(action_ids=hit.action_ids, observation_ids=obs, behaviour_logp=hit.logp,
                            policy_version=hit.version, action_text=hit.text, cut=hit.cut,
                            info={"sampling": dict(hit.sampling)}))
        s.tokens.extend(hit.action_ids)
        s.tokens.extend(obs)
        s.client_messages = list(msgs)
        s.candidates = []
        s.last_request = 0
        return None

    def record(self, s: Session, candidates: List[Candidate]) -> None:
        """The choices served for the call :meth:`prepare` answered."""
        with s.lock:
            s.served.extend(candidates)
            if s.status == "open" and s.diverged is None:
                s.candidates.extend(candidates)

    # ------------------------------------------------------------------ the end of an episode
    def finish(self, session_id: str, reward: float, *, success: Optional[bool] = None,
               info: Optional[Dict[str, Any]] = None) -> Optional[Trajectory]:
        """End the episode with ``reward``; its :class:`Trajectory` (None when nothing was sampled)."""
        s = self.get(session_id)
        with s.lock:
            if s.status != "open":
                raise RequestError(f"session: episode {session_id!r} is already {s.status}", param="session",
                                   status=409)
            s.status = "finished"
            turns = list(s.turns)
            if s.diverged is None and s.candidates:
                last = s.candidates[s.last_request:] or s.candidates
                c = last[0]
                turns.append(Turn(action_ids=c.action_ids, behaviour_logp=c.logp, policy_version=c.version,
                                  action_text=c.text, cut=c.cut, info={"sampling": dict(c.sampling)}))
                if len(last) > 1:
                    s.metadata["final_choices"] = len(last)
            traj = None
            if turns:
                turns[-1].reward = float(reward)
                samplings = [t.info["sampling"] for t in turns]
                meta = {"group_index": s.group_index, "env": "proxy", "session": s.id, "requests": s.requests,
                        "initial_potential": 0.0, **s.metadata}
                if any(x != samplings[0] for x in samplings):
                    meta["mixed_sampling"] = True
                if s.diverged is not None:
                    meta["diverged"] = s.diverged
                    meta["truncated_by"] = "diverged"
                if info:
                    meta["reward_info"] = dict(info)
                traj = Trajectory(task_id=s.task_id, episode_id=s.id, prompt_ids=s.prompt_ids, turns=turns,
                                  split=s.split, terminated=s.diverged is None, truncated=s.diverged is not None,
                                  sampling=dict(samplings[0]), success=success, metadata=meta)
            s.trajectory = traj
        with self._finished:
            self.counters["finished"] += 1
            if traj is None and s.diverged is None:
                self.counters["empty"] += 1
            self._finished.notify_all()
        return traj

    def expire(self, session_id: str) -> bool:
        """Stop an open episode without a reward (a timeout): counted, never trained. False if it had ended."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None:
            return False
        with s.lock:
            if s.status != "open":
                return False
            s.status = "expired"
        with self._lock:
            self.counters["expired"] += 1
        return True

    def pop(self, session_id: str) -> Session:
        """Remove a session (finished or expired) from the registry and return it."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
            if s is not None:
                self._ended[session_id] = s.status if s.status != "open" else "closed"
                while len(self._ended) > self.max_sessions:
                    self._ended.popitem(last=False)
        if s is None:
            raise ValueError(f"session_id: unknown session {session_id!r}")
        return s

    def wait_finished(self, session_ids: List[str], deadline: float) -> List[str]:
        """Wait until every session of ``session_ids`` has ended or ``deadline`` (monotonic) passes;
        the ids still open."""
        with self._finished:
            while True:
                left = [i for i in session_ids if i in self._sessions and self._sessions[i].status == "open"]
                remaining = deadline - time.monotonic()
                if not left or remaining <= 0:
                    return left
                self._finished.wait(timeout=min(remaining, 0.5))
