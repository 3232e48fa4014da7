r"""Conversation <-> token ids with the model's own chat template, never re-tokenizing what was sampled.

The tokenizer's chat template (``tokenizer.apply_chat_template``, with ``tools=`` schemas
when the task has tools) renders the initial conversation once (:func:`prompt_ids`). After
that the token sequence of an episode only grows by appending:

* the action tokens exactly as sampled (ending with the end-of-turn token,
  :func:`end_of_turn_id`, unless cut at ``max_new_tokens``);
* the observation tokens: what the template adds after the sampled tokens. The
  conversation is rendered with the new messages (and the next generation prompt); the
  text the tokens already hold (the prompt, every action decoded verbatim, every earlier
  observation) must be a prefix of it, and the rest, tokenized on its own, is the
  observation (:meth:`ChatSession.observe`).

So the trained sequence is the sampled sequence token for token (§4, §7): re-rendering
and re-tokenizing the whole conversation could tokenize an action differently from how it
was sampled, and the recorded behaviour log-probs would then belong to other tokens.

The prefix check: a template that renders the history differently once more messages
follow (Qwen3's drops the reasoning of earlier turns, Llama 3's trims whitespace, ...)
would make the held tokens differ from what the model sees when the conversation is
rendered for it. Such an observation is refused with :class:`TemplateMismatch` (the
episode loop raises it or ends the episode as truncated, and counts it); it is never
trained. Works for ChatML (Qwen2/3, SmolLM2), Llama-3 and Gemma templates alike; for
ChatML the observation is ``\n<|im_start|>{role}\n{content}<|im_end|>\n`` ... +
``<|im_start|>assistant\n`` (:func:`observation_text` writes it directly).

Tools: an environment, or its task source, may offer ``tool_schemas``: a list of OpenAI
function-tool JSON schemas (``{"type": "function", "function": {"name", "description",
"parameters"}}``) or a zero-argument method returning one (:func:`tool_schemas_of`). They
are passed to the template as ``tools=``; tool results come back as ``tool``-role messages.
Assistant messages carry the action text verbatim as ``content`` (tool calls included as the
model wrote them), so the template reproduces the sampled text.
"""
from __future__ import annotations

import json
import weakref
from typing import Any, Dict, List, Optional, Sequence

from .trajectory import NO_VERSION, Trajectory, Turn

__all__ = [
    "IM_START",
    "IM_END",
    "GENERATION_PROMPT",
    "ChatSession",
    "TemplateMismatch",
    "chat_text",
    "prompt_ids",
    "render_prompt",
    "observation_text",
    "observation_ids",
    "format_message",
    "encode",
    "decode_action",
    "end_of_turn_id",
    "tool_schemas_of",
    "demonstration_trajectory",
    "exchange_trajectory",
]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = IM_START + "assistant\n"
_ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = "TRAJGRADENDOFTURNPROBE"


class TemplateMismatch(ValueError):
    """The chat template renders the conversation so far differently from the tokens held."""


def _check_messages(name: str, messages: Sequence[Dict[str, str]], *, allow_empty: bool) -> List[Dict[str, str]]:
    if isinstance(messages, dict) or isinstance(messages, (str, bytes)):
        raise ValueError(f"{name}: expected a list of messages, got {type(messages).__name__}")
    messages = list(messages)
    if not messages and not allow_empty:
        raise ValueError(f"{name}: empty conversation")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{name}: each message must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in _ROLES:
            raise ValueError(f"{name}: unknown role {m['role']!r} (expected one of {_ROLES})")
        if not isinstance(m["content"], str):
            raise ValueError(f"{name}: message content must be a string, got {type(m['content']).__name__}")
    return messages


def _check_tools(tools) -> Optional[List[Dict[str, Any]]]:
    if tools is None:
        return None
    if isinstance(tools, (dict, str, bytes)) or not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools: expected a list of JSON tool schemas, got {type(tools).__name__}")
    for t in tools:
        if not isinstance(t, dict):
            raise ValueError(f"tools: each tool schema must be a dict, got {t!r}")
        try:
            json.dumps(t)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tools: a tool schema is not JSON-serializable ({exc})") from None
    return list(tools) or None


def tool_schemas_of(*owners) -> Optional[List[Dict[str, Any]]]:
    """The tool schemas the first of ``owners`` (environment, then task source) offers, or None.

    An owner offers them as ``tool_schemas``: a list of OpenAI function-tool JSON schemas,
    or a zero-argument method returning one (or None: no tools).
    """
    for owner in owners:
        attr = getattr(owner, "tool_schemas", None)
        if attr is None:
            continue
        value = attr() if callable(attr) else attr
        if value is not None:
            return _check_tools(value)
    return None


def encode(tokenizer, text: str) -> List[int]:
    """``text`` to ids with special tokens recognized and none added (no BOS)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_text(tokenizer, messages: Sequence[Dict[str, str]], *, tools=None, add_generation_prompt: bool = True) -> str:
    """``messages`` rendered as text by the tokenizer's chat template (ChatML without one)."""
    messages = _check_messages("messages", messages, allow_empty=False)
    tools = _check_tools(tools)
    if getattr(tokenizer, "chat_template", None):
        kw = {"tools": tools} if tools is not None else {}
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                 **kw)
        except Exception as exc:  # jinja2's TemplateError, raise_exception() of the template, ...
            if isinstance(exc, ValueError) and str(exc).startswith(("messages:", "tools:")):
                raise
            roles = [m["role"] for m in messages]
            raise ValueError(f"messages: the chat template refused the conversation (roles {roles}): "
                             f"{' '.join(str(exc).split())[:200]}") from None
    if tools is not None:
        raise ValueError("tools: the tokenizer has no chat template to render tool schemas with")
    return "".join(format_message(m) for m in messages) + (GENERATION_PROMPT if add_generation_prompt else "")


_EOT_CACHE: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _special_ids(tokenizer) -> set:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return {int(i) for i in ids}


def _derive_end_of_turn(tokenizer) -> Optional[int]:
    """The special token the template writes right after an assistant message's content."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    except Exception:  # a template that cannot render this probe: fall back to the tokens' names
        return None
    if _SENTINEL not in text:
        return None
    after = text[text.rindex(_SENTINEL) + len(_SENTINEL):].lstrip()
    ids = encode(tokenizer, after) if after else []
    return int(ids[0]) if ids and int(ids[0]) in _special_ids(tokenizer) else None


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant action.

    The special token the chat template writes right after an assistant message's content
    (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma);
    else ``<|im_end|>`` if the vocabulary has it; else the tokenizer's EOS token.
    """
    key = (getattr(tokenizer, "chat_template", None), len(tokenizer))
    try:
        cached = _EOT_CACHE.get(tokenizer)
    except TypeError:  # an unhashable / non-weakref-able tokenizer
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    tid = _derive_end_of_turn(tokenizer)
    if tid is None:
        im_end = tokenizer.convert_tokens_to_ids(IM_END)
        if im_end is not None and im_end != tokenizer.unk_token_id:
            tid = int(im_end)
        elif tokenizer.eos_token_id is not None:
            tid = int(tokenizer.eos_token_id)
        else:
            raise ValueError("tokenizer: cannot tell which token ends an assistant turn (no chat template end "
                             f"token, no {IM_END}, no EOS token)")
    try:
        _EOT_CACHE[tokenizer] = (key, tid)
    except TypeError:
        pass
    return tid


def prompt_ids(tokenizer, messages: Sequence[Dict[str, str]], tools=None) -> List[int]:
    """The initial conversation rendered with the chat template (with ``tools`` schemas),
    ending with the generation prompt (``add_generation_prompt=True``)."""
    return encode(tokenizer, chat_text(tokenizer, messages, tools=tools, add_generation_prompt=True))


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    r"""One conversation as messages and as the text its tokens hold (token in / token out).

    ``ChatSession(tokenizer, messages, tools=...)`` renders the prompt
    (:attr:`prompt_ids`; or takes ``prompt``, the ids :func:`prompt_ids` gave). :meth:`observe` appends one sampled action and the messages that
    follow it and returns the observation tokens: the suffix the template adds after the
    tokens held. :attr:`text` is the tokens decoded piece by piece (prompt, each action,
    each observation), so a tokenizer that does not round-trip its own text is caught by
    the same prefix check.
    """

    def __init__(self, tokenizer, messages: Sequence[Dict[str, str]], *, tools=None,
                 prompt: Optional[Sequence[int]] = None):
        self.tokenizer = tokenizer
        self.messages = _check_messages("messages", messages, allow_empty=False)
        self.tools = _check_tools(tools)
        # ``prompt``: the ids :func:`prompt_ids` gives for these messages, computed by the caller
        self.prompt_ids = list(prompt) if prompt is not None else prompt_ids(tokenizer, self.messages, self.tools)
        self.text = _decode(tokenizer, self.prompt_ids)

    def observe(self, action_ids: Sequence[int], action_text: str, messages: Sequence[Dict[str, str]], *,
                add_generation_prompt: bool = True) -> List[int]:
        """The observation tokens after ``action_ids`` (sampled; decoded ``action_text``).

        The conversation with the assistant message ``action_text`` and ``messages`` is
        rendered (with the next generation prompt when ``add_generation_prompt``); the held
        text plus the action's decoded tokens must be a prefix of it, else
        :class:`TemplateMismatch` is raised and nothing changes. On success the session
        holds the new messages and text.
        """
        new = _check_messages("messages", messages, allow_empty=True)
        tok = self.tokenizer
        history = self.messages + [{"role": "assistant", "content": action_text}] + new
        full = chat_text(tok, history, tools=self.tools, add_generation_prompt=add_generation_prompt)
        held = self.text + _decode(tok, action_ids)
        if not full.startswith(held):
            at = _first_difference(held, full)
            raise TemplateMismatch(
                "the chat template renders the conversation so far differently from the tokens already sampled "
                f"(from character {at}: held {held[at:at + 40]!r}, rendered {full[at:at + 40]!r}); the template "
                "rewrites earlier turns (e.g. drops reasoning or trims whitespace) or the tokenizer does not "
                "round-trip its text, and such tokens are never trained")
        obs = encode(tok, full[len(held):])
        self.messages = history
        self.text = held + _decode(tok, obs)
        return obs


def format_message(message: Dict[str, str]) -> str:
    """One ChatML message: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
    return f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n"


def observation_text(messages: Sequence[Dict[str, str]], *, action_closed: bool = True, add_generation_prompt: bool = True) -> str:
    """The ChatML text appended after an assistant action (what :meth:`ChatSession.observe`
    gives for a ChatML template).

    ``action_closed``: the action ended with ``<|im_end|>`` (it was not cut at
    ``max_new_tokens``); otherwise the observation starts by closing the assistant
    message with ``<|im_end|>``, a token the policy did not sample (so it is masked).
    """
    messages = _check_messages("messages", messages, allow_empty=True)
    head = "\n" if action_closed else IM_END + "\n"
    body = "".join(format_message(m) for m in messages)
    return head + body + (GENERATION_PROMPT if add_generation_prompt else "")


def observation_ids(
    tokenizer,
    messages: Sequence[Dict[str, str]],
    *,
    action_closed: bool = True,
    add_generation_prompt: bool = True,
) -> List[int]:
    """Tokens of :func:`observation_text` (ChatML), tokenized on their own.

    Example (action closed, one user message ``"<result>4</result>"``)::

        "\\n<|im_start|>user\\n<result>4</result><|im_end|>\\n<|im_start|>assistant\\n"
    """
    return encode(
        tokenizer,
        observation_text(messages, action_closed=action_closed, add_generation_prompt=add_generation_prompt),
    )


def decode_action(tokenizer, action_ids: Sequence[int], eos_id: int) -> str:
    """The action text handed to the environment: the tokens decoded verbatim, without the
    final end-of-turn token."""
    ids = list(action_ids)
    if ids and ids[-1] == eos_id:
        ids = ids[:-1]
    return _decode(tokenizer, ids)


render_prompt = prompt_ids


def demonstration_trajectory(tokenizer, source, task, *, env=None):
    """A :class:`~trajgrad.rollout.trajectory.Trajectory` of a task's demonstration (SFT, DPO).

    The prompt is the environment's initial conversation (``env.reset(task)``, a fresh
    ``source.make_env()``, closed afterwards, unless ``env`` is given); ``source.demonstration(task)`` must be
    a list of messages starting with an assistant message. Each assistant message becomes
    an action (its content tokens + the end-of-turn token); the messages up to the next
    assistant message become that turn's observation, exactly as the sampler would append
    them (:meth:`ChatSession.observe`; a template that re-renders the history differently
    raises :class:`TemplateMismatch`).

    The tokens were not sampled by a policy: ``behaviour_logp`` holds 0.0 placeholders and
    ``policy_version`` is -1. Use it for likelihood terms (SFT, DPO), never as the
    behaviour of an importance ratio. ``success`` is True, rewards are 0,
    ``metadata["demonstration"]`` is True.
    """
    if env is None:  # an environment made here is closed here (e.g. its episode's MCP servers)
        env = source.make_env()
        try:
            return demonstration_trajectory(tokenizer, source, task, env=env)
        finally:
            getattr(env, "close", lambda: None)()
    return exchange_trajectory(tokenizer, list(env.reset(task)), source.demonstration(task), task,
                               tools=tool_schemas_of(env, source), env_name=getattr(env, "name", ""))


def exchange_trajectory(tokenizer, messages: Sequence[Dict[str, str]], demo: Sequence[Dict[str, str]], task, *,
                        tools=None, env_name: str = ""):
    """The :class:`~trajgrad.rollout.trajectory.Trajectory` of the exchange ``demo`` after the conversation
    ``messages`` (rendered with ``tools``), as :func:`demonstration_trajectory` describes it.

    ``demo`` starts with an assistant message; each assistant message is an action (its content tokens
    + the end-of-turn token), the messages up to the next one its observation
    (:meth:`ChatSession.observe`). Both lists hold ``{"role", "content"}`` messages as the template
    renders them.
    """
    demo = _check_messages("demonstration", demo, allow_empty=False)
    if demo[0]["role"] != "assistant":
        raise ValueError(f"demonstration: must start with an assistant message, got role {demo[0]['role']!r}")
    eos = end_of_turn_id(tokenizer)
    session = ChatSession(tokenizer, messages, tools=tools)
    turns = []
    i = 0
    while i < len(demo):
        j = i + 1
        while j < len(demo) and demo[j]["role"] != "assistant":
            j += 1
        action = encode(tokenizer, demo[i]["content"]) + [eos]
        following = demo[i + 1:j]
        last = j >= len(demo)
        if last and not following:
            obs = []
        else:
            obs = session.observe(action, demo[i]["content"], following, add_generation_prompt=not last)
        turns.append(Turn(action_ids=action, observation_ids=obs, behaviour_logp=[0.0] * len(action),
                          policy_version=NO_VERSION, action_text=demo[i]["content"]))
        i = j
    return Trajectory(
        task_id=task.id, episode_id=f"{task.id}#demo", split=getattr(task, "split", "train"),
        prompt_ids=session.prompt_ids, turns=turns, terminated=True, success=True,
        sampling={"demonstration": True}, metadata={"demonstration": True, "env": env_name},
    )
