r"""Conversation <-> token ids, in ChatML, without ever re-tokenizing what was sampled.

ChatML (SmolLM2's format)::

    <|im_start|>{role}\n{content}<|im_end|>\n      one message
    <|im_start|>assistant\n                        the generation prompt

The initial conversation is rendered once with the tokenizer's chat template
(:func:`prompt_ids`). After that the token sequence only grows by appending:

* the action tokens exactly as sampled (ending with ``<|im_end|>``);
* the observation tokens (:func:`observation_ids`): the text that follows the action,
  ``\n`` + each new message in ChatML + the next generation prompt, tokenized on its own.

So the trained sequence is the sampled sequence token for token (§4, §7): re-rendering
the whole conversation could tokenize the action differently from how it was sampled,
and the recorded behaviour log-probs would then belong to other tokens.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

__all__ = [
    "IM_START",
    "IM_END",
    "GENERATION_PROMPT",
    "prompt_ids",
    "render_prompt",
    "observation_text",
    "observation_ids",
    "format_message",
    "encode",
    "decode_action",
    "end_of_turn_id",
    "demonstration_trajectory",
]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = IM_START + "assistant\n"
_ROLES = ("system", "user", "assistant", "tool")


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


def encode(tokenizer, text: str) -> List[int]:
    """``text`` to ids with special tokens recognized and none added (no BOS)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_of_turn_id(tokenizer) -> int:
    """The id of ``<|im_end|>`` (the token that ends an assistant action)."""
    tid = tokenizer.convert_tokens_to_ids(IM_END)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer: has no {IM_END} token; a ChatML tokenizer is required")
    return int(tid)


def prompt_ids(tokenizer, messages: Sequence[Dict[str, str]]) -> List[int]:
    """The initial conversation rendered with the chat template, ending with the
    generation prompt ``<|im_start|>assistant\\n`` (``add_generation_prompt=True``)."""
    messages = _check_messages("messages", messages, allow_empty=False)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "".join(format_message(m) for m in messages) + GENERATION_PROMPT
    return encode(tokenizer, text)


def format_message(message: Dict[str, str]) -> str:
    """One ChatML message: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
    return f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n"


def observation_text(messages: Sequence[Dict[str, str]], *, action_closed: bool = True, add_generation_prompt: bool = True) -> str:
    """The text appended after an assistant action.

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
    """Tokens of :func:`observation_text`, tokenized on their own and appended verbatim.

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
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
render_prompt = prompt_ids


def demonstration_trajectory(tokenizer, source, task, *, env=None):
    """A :class:`~trajgrad.rollout.trajectory.Trajectory` of a task's demonstration (SFT, DPO).

    The prompt is the environment's initial conversation (``env.reset(task)``, a fresh
    ``source.make_env()`` unless ``env`` is given); ``source.demonstration(task)`` must be
    a list of messages starting with an assistant message. Each assistant message becomes
    an action (its content tokens + ``<|im_end|>``); the messages up to the next assistant
    message become that turn's observation, exactly as the sampler would append them.

    The tokens were not sampled by a policy: ``behaviour_logp`` holds 0.0 placeholders and
    ``policy_version`` is -1. Use it for likelihood terms (SFT, DPO), never as the
    behaviour of an importance ratio. ``success`` is True, rewards are 0,
    ``metadata["demonstration"]`` is True.
    """
    from .trajectory import NO_VERSION, Trajectory, Turn

    env = source.make_env() if env is None else env
    messages = list(env.reset(task))
    demo = _check_messages("demonstration", source.demonstration(task), allow_empty=False)
    if demo[0]["role"] != "assistant":
        raise ValueError(f"demonstration: must start with an assistant message, got role {demo[0]['role']!r}")
    eos = end_of_turn_id(tokenizer)
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
            obs = observation_ids(tokenizer, following, add_generation_prompt=not last)
        turns.append(Turn(action_ids=action, observation_ids=obs, behaviour_logp=[0.0] * len(action),
                          policy_version=NO_VERSION, action_text=demo[i]["content"]))
        i = j
    return Trajectory(
        task_id=task.id, episode_id=f"{task.id}#demo", split=getattr(task, "split", "train"),
        prompt_ids=prompt_ids(tokenizer, messages), turns=turns, terminated=True, success=True,
        sampling={"demonstration": True}, metadata={"demonstration": True, "env": getattr(env, "name", "")},
    )
