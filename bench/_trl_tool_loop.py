"""The calculator's ``<calc>`` tag protocol for TRL's own tool loop (``GRPOTrainer(environment_factory=...)``).

TRL 1.16's GRPOTrainer runs tools itself: it parses each sampled turn with the tokenizer's
*response template* (transformers' response parsing), calls the tool methods of the
rollout's environment, renders the tool messages with the *chat template* and samples the
next turn. It refuses a chat template that cannot render tool calls, and has no response
template for SmolLM2's ChatML. This module gives both, for the calculator's protocol, in two
ways (``--trl-loops`` of ``bench_trl_tta.py``)::

    assistant: <calc>12 + 7 * 31 - 5</calc>        (a tool call: calc(expression="12 + 7 * 31 - 5"))
    user:      <result>224</result>                (the tool message, rendered as trajgrad's env writes it)
    assistant: <answer>224</answer>

* :func:`tag_tool_template`: the tokenizer's own chat template behind a Jinja prelude that
  rewrites an assistant message's ``tool_calls`` into ``<NAME>EXPRESSION</NAME>`` (JSON
  arguments for a tool with other arguments) and a ``tool`` message into a ``user`` message
  ``<result>CONTENT</result>``, so a conversation renders to the very text trajgrad's
  calculator conversation renders to (the ``tools=`` schemas are not rendered: trajgrad's
  env lists no tools either, its one-shot example shows the protocol).
* :func:`tag_response_template`: a ``<calc>`` tag is a tool call only when it is complete
  (``</calc>`` follows) and no complete ``<answer>`` tag precedes it, as
  ``CalculatorEnv``'s first-action rule decides.
* ``calc`` loop, :class:`CalculatorTools`: the calculator is the tool ``calc(expression)``,
  parsed from the tag by :func:`tag_response_template`; as in any TRL tool loop, a turn
  without a tool call ends the episode (where the env would answer a turn without an action
  with an error message and give another turn).
* ``env`` loop, :class:`EnvTurns`: every turn that does not end the episode is the tool call
  ``step(action=TURN)`` (:func:`env_turn_parser`: the env itself tells whether a turn ends the
  episode), the env's observation is the tool message: the env's protocol turn for turn.

Either way the rollout's environment is trajgrad's own ``CalculatorEnv`` behind TRL's
tool-method interface, :meth:`_Episode._finish` feeds it the final turn, and the reward is
the env's own episode return (:func:`env_reward`).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

__all__ = ["TOOL_PRELUDE", "tag_tool_template", "tag_response_template", "CalculatorTools", "EnvTurns",
           "env_turn_parser", "env_reward"]

# Rewrites tool calls and tool messages into the tag protocol, then hands ``messages`` to the
# tokenizer's own template (which follows this prelude unchanged).
TOOL_PRELUDE = """{%- set ns = namespace(msgs=[]) -%}
{%- for m in messages -%}
{%- if m['role'] == 'tool' -%}
{%- set ns.msgs = ns.msgs + [{'role': 'user', 'content': '<result>' + (m['content'] | string) + '</result>'}] -%}
{%- elif m['role'] == 'assistant' and m.get('tool_calls') -%}
{%- set text = namespace(v=(m['content'] or '')) -%}
{%- for call in m['tool_calls'] -%}
{%- set f = call['function'] if call.get('function') else call -%}
{%- set a = f['arguments'] -%}
{%- if a is mapping and a | length == 1 and 'action' in a -%}{%- set text.v = text.v + (a['action'] | string) -%}
{%- else -%}
{%- if a is mapping and a | length == 1 and 'expression' in a -%}{%- set v = a['expression'] | string -%}
{%- elif a is string -%}{%- set v = a -%}
{%- else -%}{%- set v = a | tojson -%}{%- endif -%}
{%- set text.v = text.v + '<' + f['name'] + '>' + v + '</' + f['name'] + '>' -%}
{%- endif -%}
{%- endfor -%}
{%- set ns.msgs = ns.msgs + [{'role': 'assistant', 'content': text.v}] -%}
{%- else -%}
{%- set ns.msgs = ns.msgs + [{'role': m['role'], 'content': m['content']}] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = ns.msgs -%}
"""


def tag_tool_template(chat_template: str) -> str:
    """``chat_template`` (a ChatML-like template reading ``message['role']`` and ``['content']``)
    that also renders tool calls and tool messages in the tag protocol."""
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError("chat_template: the tokenizer has no chat template to extend")
    return TOOL_PRELUDE + chat_template


def tag_response_template(tool: str = "calc", *, end_of_turn: str = "<|im_end|>",
                          assistant_header: str = "<|im_start|>assistant\n") -> Dict[str, Any]:
    """A transformers ``response_template`` parsing ``<tool>EXPRESSION</tool>`` into a tool call
    ``tool(expression=EXPRESSION)``: only the first complete tag, and only when no ``<answer>``
    tag that a ``</answer>`` closes opens before it (the env's first action decides)."""
    import re

    t = re.escape(tool)
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": assistant_header,
        "fields": {
            "tool_calls": {
                # the first tag, complete, not after an <answer> that a </answer> closes (before or after it)
                "open_pattern": rf"(?<!<{t}>[\s\S]*)(?<!<answer>[\s\S]*?</answer>[\s\S]*)"
                                rf"(?!(?<=<answer>[\s\S]*)[\s\S]*?</answer>)<(?P<name>{t})>"
                                rf"(?=[\s\S]*?</{t}>)",
                "close_pattern": rf"</{t}>",
                "repeats": True,
                "content": "text",
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": {"expression": "{content}"}}},
            },
            "content": {"close_pattern": re.escape(end_of_turn) + r"\s*", "content": "text"},
        },
    }


class _Episode:
    """One rollout's environment for TRL: trajgrad's ``CalculatorEnv`` (``source.make_env()``).

    ``reset(task=JSON)`` starts the env's episode on that task (the prompt is the dataset's:
    the messages ``env.reset`` returned when the dataset was built); the subclass's public
    method is the tool TRL calls; :meth:`_finish` steps the env with the rollout's last
    assistant turn and returns the episode return (the env's rewards summed: format bonus and
    answer). ``counts`` (shared) records where TRL's loop and the env's protocol part ways.
    """

    counts: Dict[str, int] = {"episodes": 0, "ended_before_env": 0, "tool_calls": 0}

    def __init__(self, source) -> None:
        self.source = source
        self.env = source.make_env()
        self.total = 0.0
        self.done = True

    def reset(self, task: Optional[str] = None, **_: Any) -> None:
        from trajgrad.envs.task import Task

        if task is None:
            raise ValueError("reset: the dataset row has no 'task' column")
        self.env.reset(Task(**json.loads(task)))
        self.total, self.done = 0.0, False
        return None

    def _advance(self, action: str) -> str:
        """The env's answer to one turn, without its ``<result>`` tags (the template writes them)."""
        if self.done:  # TRL called a tool after the env's episode ended (the env's turn limit)
            return "error: the episode is over"
        res = self.env.step(action)
        self.total += float(res.reward)
        self.done = bool(res.terminated or res.truncated)
        if not res.messages:
            return "error: the episode is over"
        content = res.messages[0]["content"]
        if not (content.startswith("<result>") and content.endswith("</result>")):
            raise ValueError(f"env: expected a <result> observation, got {content[:80]!r}")
        return content[len("<result>"):-len("</result>")]

    def _finish(self, messages: List[Dict[str, Any]]) -> float:
        """The env's episode return after the rollout's last assistant turn (``messages``: TRL's
        completion, the assistant and tool messages after the prompt)."""
        _Episode.counts["episodes"] += 1
        last = messages[-1] if messages else None
        if not self.done:
            text = ""  # the last turn was cut away (empty) after a tool message
            if last is not None and last.get("role") == "assistant":
                text = last.get("content") or ""
                for call in last.get("tool_calls") or []:  # the turn limit of TRL's loop was reached
                    f = call.get("function", call)
                    args = f.get("arguments") or {}
                    text += args["action"] if "action" in args else f"<{f['name']}>{args.get('expression', '')}</{f['name']}>"
            self._advance(text)
            if not self.done:  # a turn without an action: the env would give another turn, TRL ends here
                _Episode.counts["ended_before_env"] += 1
        return self.total


class CalculatorTools(_Episode):
    """TRL's tool calling with the calculator as the tool: ``calc(expression)``."""

    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression with the calculator.

        Args:
            expression: the arithmetic expression, e.g. 12 + 7 * 31 - 5.
        """
        _Episode.counts["tool_calls"] += 1
        return self._advance(f"<calc>{expression}</calc>")


class EnvTurns(_Episode):
    """Every turn that does not end the episode goes to the env as the tool call ``step(action)``
    (:func:`env_turn_parser` makes it one), and the env's observation comes back."""

    def step(self, action: str) -> str:
        """Send the assistant's turn to the calculator environment.

        Args:
            action: the text of the assistant's turn.
        """
        _Episode.counts["tool_calls"] += 1
        return self._advance(action)


def env_turn_parser(tokenizer, source):
    """A ``parse_response`` for the tokenizer: a sampled turn is the tool call ``step(action=TEXT)``
    (TEXT: the turn as trajgrad hands it to the env, ``decode_action``) unless the env ends the
    episode on it (its first action is an answer), as a fresh env of ``source`` decides."""
    from trajgrad.rollout.chat import decode_action, end_of_turn_id

    probe, task = source.make_env(), source.tasks("train", 1, 0)[0]
    eos = end_of_turn_id(tokenizer)

    def parse_response(ids, prefix=None, tools=None):
        text = decode_action(tokenizer, [int(i) for i in ids], eos)
        probe.reset(task)
        res = probe.step(text)
        if res.terminated and "answer" in res.info:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "step", "arguments": {"action": text}}}]}

    return parse_response


def env_reward(completions, environments, **_: Any) -> List[float]:
    """TRL reward function: each rollout's env episode return (:meth:`_Episode._finish`)."""
    return [env._finish(list(c) if isinstance(c, list) else [{"role": "assistant", "content": c}])
            for env, c in zip(environments, completions)]
