r"""Task source ``"dataset"``: prompts from a file or a ``datasets`` directory, scored by reward functions.

The workflow of TRL's ``GRPOTrainer(reward_funcs=..., train_dataset=...)``: each row
holds a prompt (``prompt_field``, a string or a list of chat messages) and any other
columns; each reward function is called the way TRL calls it,

.. code-block:: python

    fn(prompts=[prompt], completions=[completion], **{column: [value] for other columns})
        -> [float]        # or a single float; None counts as 0

(``completion`` is the reply text for a string prompt, ``[{"role": "assistant",
"content": text}]`` for a chat prompt), so reward functions written for TRL work
unchanged. With several functions the episode's reward is :math:`\sum_i w_i r_i`
(``reward`` as ``{"mod:fn": weight}``; a list or a single string weighs each 1).
``info["success"]`` is ``reward >= success_threshold``.

With ``tools`` (import strings of typed functions, and MCP servers as ``{"mcp": {"command":
..., "args": [...]}}`` or ``{"mcp": {"url": ...}}``, :mod:`trajgrad.envs.mcp`) the task is a
tool task (:class:`~trajgrad.envs.toolenv.ToolEnv`): the model may call the tools for up to
``max_turns`` turns, and its final reply is scored by the reward functions. An MCP server is
started and its tools listed when the source is built (at config load); each episode then
gets its own server unless it is ``shared``.

Sources (``path``): ``.jsonl`` / ``.json`` (JSON lines, or a JSON list), ``.parquet``,
or a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a
``DatasetDict`` whose ``train`` split is used). Held-out tasks (``heldout``): a fraction
of the rows chosen by the hash of the prompt (default 0.1), a second file or directory,
or, when ``path`` is a ``DatasetDict`` with a ``test`` / ``validation`` split and
``heldout`` is not given, that split. Held-out rows that repeat a prompt and answer are one
task; more held-out tasks than distinct rows cycle through them (refused at load unless
``eval.distinct: warn``, :mod:`trajgrad.train.heldout`).

A reward function that cannot be imported, is not callable, raises on the first training
row (probed with the row's answer, or ``""``, as the completion) or returns something
that is not a number raises ``ValueError("reward...: ...")`` when the source is built,
i.e. at config load. One that raises or returns NaN later is a
:class:`~trajgrad.envs.base.TaskError` naming it and the task (``trajgrad train`` prints that one
line); a reward is never silently replaced by 0.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .base import Message, StepResult, Task, TaskError, register_task_source, resolve_import
from .mcp import MCPTools
from .schema import function_tool
from .splits import hash_split, take
from .toolenv import ToolEnv

__all__ = ["DatasetConfig", "DatasetSource", "DatasetEnv", "load_rows", "load_rewards"]

RewardSpec = Union[str, List[str], Dict[str, float]]


@dataclass(frozen=True)
class DatasetConfig:
    """Options of the ``"dataset"`` task source (``task.dataset`` / ``task.reward`` /
    ``task.heldout`` set ``path`` / ``reward`` / ``heldout``).

    Attributes:
      path: the prompts: a .jsonl/.json/.parquet file or a ``datasets`` directory (required).
      reward: the reward functions: ``"module:function"``, a list (each weighs 1) or
        ``{"module:function": weight}``; called as TRL calls them (``prompts=``,
        ``completions=`` and the row's other columns), the episode's reward is their weighted sum.
      heldout: held-out rows: a fraction of the rows chosen by the hash of the prompt
        (default 0.1), a second file or directory, or the DatasetDict's test split.
      prompt_field: the column holding the prompt (a string or a list of chat messages).
      answer_field: the column holding the reference answer (the demonstrations of ``sft.steps``
        and the completion that probes the rewards at load time).
      system_prompt: a system message before the prompt (None = none).
      tools: ``"module:function"`` tools the model may call (multi-turn); None = single-turn.
      max_turns: assistant turns per episode (1 without tools).
      success_threshold: a total reward at least this high counts as a success.
    """

    path: str = ""
    reward: Optional[RewardSpec] = None
    heldout: Optional[Union[float, str]] = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    system_prompt: Optional[str] = None
    tools: Optional[List[Union[str, Dict[str, Any]]]] = None
    max_turns: int = 1
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: the dataset's path is required (task.dataset)")
        if self.reward is None:
            raise ValueError("reward: at least one reward function is required (task.reward: 'module:function')")
        if isinstance(self.heldout, (int, float)) and not isinstance(self.heldout, bool):
            if not 0.0 <= float(self.heldout) < 1.0:
                raise ValueError(f"heldout: a fraction must be in [0, 1), got {self.heldout!r}")
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ValueError(f"max_turns: expected an integer >= 1, got {self.max_turns!r}")
        if self.tools is None and self.max_turns != 1:
            raise ValueError("max_turns: a dataset task without tools is single-turn (max_turns 1)")


# ----------------------------------------------------------------------------- loading


def _read_file(path: Path, key: str) -> List[dict]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover
            raise ValueError(f"{key}: reading {str(path)!r} needs pyarrow (pip install pyarrow)") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise ValueError(f"{key}: cannot read Parquet file {str(path)!r} ({type(exc).__name__}: {exc})") from None
    if suffix in (".jsonl", ".json"):
        text = path.read_text()
        if suffix == ".json" and text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{key}: {str(path)!r} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
        else:
            rows = []
            for k, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{key}: line {k} of {str(path)!r} is not valid JSON ({exc.msg})") from None
        bad = [k for k, r in enumerate(rows) if not isinstance(r, dict)]
        if bad:
            raise ValueError(f"{key}: row {bad[0]} of {str(path)!r} is not a JSON object")
        return rows
    raise ValueError(f"{key}: unsupported file type {suffix!r} of {str(path)!r} (use .jsonl, .json, .parquet "
                     "or a datasets directory)")


def _read_dir(path: Path, key: str) -> Tuple[List[dict], Optional[List[dict]]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        raise ValueError(f"{key}: {str(path)!r} is a directory; reading it needs `datasets` (pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ValueError(f"{key}: {str(path)!r} is not a directory written by datasets' save_to_disk "
                         f"({type(exc).__name__}: {exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{key}: the DatasetDict at {str(path)!r} has no 'train' split (splits: {sorted(ds)})")
        held = next((ds[s] for s in ("test", "validation", "heldout") if s in ds), None)
        return ds["train"].to_list(), (held.to_list() if held is not None else None)
    return ds.to_list(), None


def load_rows(path: str, *, key: str = "path") -> Tuple[List[dict], Optional[List[dict]]]:
    """(rows, held-out rows of a ``DatasetDict`` or None) of a JSONL/JSON/Parquet file or a
    ``datasets`` directory; ValueError starting with ``key`` for a bad path or content."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{key}: no such file or directory {str(p)!r} (relative paths start at {str(Path.cwd())!r})")
    rows, held = _read_dir(p, key) if p.is_dir() else (_read_file(p, key), None)
    if not rows:
        raise ValueError(f"{key}: {str(p)!r} holds no rows")
    return rows, held


def _reward_items(spec: RewardSpec) -> List[Tuple[str, str, float]]:
    """[(dotted key, import string, weight)]."""
    if isinstance(spec, str):
        return [("reward", spec, 1.0)]
    if isinstance(spec, list):
        if not spec:
            raise ValueError("reward: expected at least one reward function")
        return [(f"reward.{k}", s, 1.0) for k, s in enumerate(spec)]
    if isinstance(spec, dict):
        if not spec:
            raise ValueError("reward: expected at least one reward function")
        out = []
        for s, w in spec.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ValueError(f"reward[{s}]: a weight must be a finite number, got {w!r}")
            out.append((f"reward[{s}]", s, float(w)))
        return out
    raise ValueError(f"reward: expected 'module:function', a list of them, or {{'module:function': weight}}, got {spec!r}")


def load_rewards(spec: RewardSpec) -> List[Tuple[str, Callable, float]]:
    """[(dotted key, function, weight)] of a reward spec; ValueError naming the key."""
    out = []
    for key, s, w in _reward_items(spec):
        if not isinstance(s, str):
            raise ValueError(f"{key}: expected an import string 'module:function', got {s!r}")
        fn = resolve_import(s, key=key)
        if not callable(fn):
            raise ValueError(f"{key}: {s!r} is a {type(fn).__name__}, not a function")
        out.append((key, fn, w))
    return out


def _as_messages(prompt: Any, key: str) -> List[Message]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ValueError(f"{key}: a prompt must be a string or a list of {{'role', 'content'}} messages, got {prompt!r:.80}")


# ----------------------------------------------------------------------------- environment


def score_completion(rewards, row: dict, prompt_field: str, completion: str) -> Tuple[float, Dict[str, float]]:
    """(weighted reward, {function key: reward}) of ``completion`` for ``row``; a function that
    raises or returns a non-number (or NaN, inf) raises :class:`~trajgrad.envs.base.TaskError`
    (a ``RuntimeError``) naming its key."""
    prompt = row[prompt_field]
    comp: Any = completion if isinstance(prompt, str) else [{"role": "assistant", "content": completion}]
    columns = {k: [v] for k, v in row.items() if k != prompt_field}
    total, parts = 0.0, {}
    for key, fn, w in rewards:
        try:
            out = fn(prompts=[prompt], completions=[comp], **columns)
        except Exception as exc:
            raise TaskError(f"task.{key}: reward function {getattr(fn, '__qualname__', fn)!r} raised "
                               f"{type(exc).__name__}: {exc}") from exc
        value = out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out
        if value is None:
            value = 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise TaskError(f"task.{key}: reward function {getattr(fn, '__qualname__', fn)!r} returned {out!r}; "
                               "expected [float] (one reward per completion) or a finite float")
        parts[key] = float(value)
        total += w * float(value)
    return total, parts


class DatasetEnv:
    """One episode over one row: the prompt, one reply (or tool turns then a reply), the rewards."""

    def __init__(self, source: "DatasetSource") -> None:
        self.source, self.name = source, "dataset"
        self.max_turns = source.config.max_turns
        self._row: Optional[dict] = None
        self._task_id: Optional[str] = None
        self._tools = None
        if source.tools or source.mcp:
            self._tools = ToolEnv(source.tools, lambda text, task: self._score(text)[0], max_turns=self.max_turns,
                                  system_prompt=source.config.system_prompt or "",
                                  success_threshold=source.config.success_threshold, mcp=source.mcp)

    def _score(self, text: str):
        try:
            return score_completion(self.source.rewards, self._row, self.source.config.prompt_field, text)
        except TaskError as exc:
            prompt = " ".join(str(self._row[self.source.config.prompt_field]).split())
            raise TaskError(f"{exc}; task {self._task_id!r} (prompt {prompt[:80]!r})") from exc

    def reset(self, task: Task) -> List[Message]:
        self._row, self._task_id = task.metadata["row"], task.id
        msgs = _as_messages(self._row[self.source.config.prompt_field], "prompt")
        if self._tools is not None:
            head = self._tools.reset(task)[:1]  # the system message listing the tools
            return head + [m for m in msgs if m["role"] != "system"]
        sp = self.source.config.system_prompt
        return ([{"role": "system", "content": sp}] if sp and msgs[0]["role"] != "system" else []) + msgs

    def potential(self) -> float:
        return 0.0

    def close(self) -> None:
        """End the episode's MCP servers, if any."""
        if self._tools is not None:
            self._tools.close()

    def step(self, action_text: str) -> StepResult:
        if self._row is None:
            raise ValueError("step: call reset(task) first")
        if self._tools is not None:
            return self._tools.step(action_text)
        total, parts = self._score(action_text)
        info = {"success": total >= self.source.config.success_threshold, **{f"reward/{k}": v for k, v in parts.items()}}
        return StepResult([], total, True, False, info)


@register_task_source("dataset")
class DatasetSource:
    """Task source ``"dataset"`` (options: :class:`DatasetConfig`)."""

    name = "dataset"
    options_class = DatasetConfig

    def __init__(self, **kwargs: Any) -> None:
        self.config = c = DatasetConfig(**kwargs)
        rows, held = load_rows(c.path, key="path")
        bad = [k for k, r in enumerate(rows) if c.prompt_field not in r]
        if bad:
            raise ValueError(f"prompt_field: row {bad[0]} has no column {c.prompt_field!r} (columns: {sorted(rows[bad[0]])})")
        for k, r in enumerate(rows[:1]):
            _as_messages(r[c.prompt_field], "prompt_field")
        if isinstance(c.heldout, str):
            held, _ = load_rows(c.heldout, key="heldout")
            split = {"train": rows, "heldout": held}
        elif held is not None and c.heldout is None:
            split = {"train": rows, "heldout": held}
        else:
            frac = 0.1 if c.heldout is None else float(c.heldout)
            split = {"train": [], "heldout": []}
            for r in rows:
                split[hash_split(json.dumps(r[c.prompt_field], sort_keys=True), frac)].append(r)
            if not split["train"]:
                raise ValueError(f"heldout: the fraction {frac} leaves no training rows of {len(rows)}")
            if frac > 0 and not split["heldout"]:
                split["heldout"] = split["train"][-1:]
        if not split["heldout"]:
            split["heldout"] = split["train"][-1:]
        self.rows = split
        self.rewards = load_rewards(c.reward)
        self.tools, self.mcp = [], []
        for k, spec in enumerate(c.tools or []):
            if isinstance(spec, dict):
                if set(spec) != {"mcp"}:
                    raise ValueError(f"tools.{k}: expected an import string 'module:function' or {{mcp: {{command: "
                                     f"..., args: [...]}}}} / {{mcp: {{url: ...}}}}, got keys {sorted(spec)}")

                self.mcp.append(MCPTools(spec, key=f"tools.{k}"))
                continue
            fn = resolve_import(spec, key=f"tools.{k}")

            try:
                self.tools.append(function_tool(fn))
            except ValueError as exc:
                raise ValueError(f"tools.{k}: {exc}") from None
        probe = split["train"][0]
        answer = probe.get(c.answer_field)
        try:
            score_completion(self.rewards, probe, c.prompt_field, "" if answer is None else str(answer))
        except RuntimeError as exc:
            raise ValueError(str(exc).removeprefix("task.") + " (probed on the first training row at load)") from None

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split: expected 'train' or 'heldout', got {split!r}")
        pool = list(enumerate(self.rows[split]))
        if split == "heldout":  # rows repeating a prompt and answer are one task: the first of them
            c, firsts = self.config, {}
            for idx, row in pool:
                firsts.setdefault(json.dumps([row[c.prompt_field], row.get(c.answer_field)], sort_keys=True,
                                             default=str), (idx, row))
            pool = list(firsts.values())
        picked = take(pool, n, seed, what=f"{split} rows")
        c, out, seen = self.config, [], {}
        for idx, row in picked:
            k = seen[idx] = seen.get(idx, -1) + 1
            msgs = _as_messages(row[c.prompt_field], "prompt")
            out.append(Task(id=f"ds-{split}-{idx}" + (f"#{k}" if k else ""), split=split,
                            prompt=msgs[-1]["content"], answer=row.get(c.answer_field), metadata={"row": row}))
        return out

    def make_env(self, **kwargs: Any) -> DatasetEnv:
        return DatasetEnv(self)

    def demonstration(self, task: Task) -> List[Message]:
        if task.answer is None:
            raise ValueError(f"sft.steps: the dataset has no {self.config.answer_field!r} column to demonstrate; "
                             "set sft.steps to 0")
        return [{"role": "assistant", "content": str(task.answer)}]
