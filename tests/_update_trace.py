"""The trajgrad source files one policy step executes, recorded with :func:`sys.settrace`.

The trace opens at the line of ``Trainer.learn`` that starts its policy step (the comment
``# N. the policy update``) and closes when the policy optimizer's ``step()`` is called: every
trajgrad file with a Python frame in between is recorded, ``train/trainer.py`` (``learn``
itself) included. Torch, the standard library and other packages are not trajgrad files. The
policy network is one opaque call, as torch's modules are: frames in ``model/`` and
``fused/`` (the forward pass that gives the log-probs, and the backward pass of its chunked
head), and everything they call, are left out. So is ``_moved.py``, the finder of the old
module paths: Python's import system consults it whenever a module not yet loaded is imported
(torch imports some lazily during a step); it is import machinery, not the update.
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from pathlib import Path
from typing import List, Set

import trajgrad
from trajgrad.train.trainer import Trainer

ROOT = Path(trajgrad.__file__).resolve().parent
NETWORK = tuple(str(ROOT / d) + "/" for d in ("model", "fused"))
IMPORT_MACHINERY = str(ROOT / "_moved.py")


def numbered_steps(fn=Trainer.learn) -> List[tuple]:
    """``(number, title, statement)`` of each ``# N. title`` comment in ``fn``'s body: the
    statement that follows it (an :mod:`ast` node)."""
    src = textwrap.dedent(inspect.getsource(fn))
    lines = src.splitlines()
    body = ast.parse(src).body[0].body
    out = []
    for i, line in enumerate(lines, start=1):
        text = line.strip()
        head = text[2:].split(".", 1)
        if text.startswith("# ") and head[0].isdigit() and len(head) == 2:
            after = [s for s in ast.walk(ast.Module(body=body, type_ignores=[]))
                     if isinstance(s, ast.stmt) and s.lineno > i]
            nxt = min(after, key=lambda s: (s.lineno, -s.end_lineno)) if after else None
            out.append((int(head[0]), head[1].strip(), nxt))
    return out


def policy_step_line(fn=Trainer.learn) -> int:
    """The absolute line number of the comment that opens ``fn``'s policy step."""
    lines, first = inspect.getsourcelines(fn)
    for k, line in enumerate(lines):
        if line.strip().startswith("# ") and "policy update" in line:
            return first + k
    raise AssertionError(f"{fn.__qualname__}: no '# N. the policy update' comment")


def trace_policy_step(trainer: Trainer, trajs) -> Set[str]:
    """Run ``trainer.learn(trajs)`` and return the trajgrad files (relative to the package,
    e.g. ``"train/updates.py"``) executed from its policy step to ``optimizer.step()``."""
    start = policy_step_line(type(trainer).learn)
    learn_code = type(trainer).learn.__code__
    state = {"on": False, "done": False}
    files: Set[str] = set()

    def in_learn(frame, event, arg):
        if event == "line" and not state["done"] and frame.f_lineno >= start:
            state["on"] = True
        return in_learn

    def in_network(frame) -> bool:
        while frame is not None and frame.f_code is not learn_code:
            if frame.f_code.co_filename.startswith(NETWORK):
                return True
            frame = frame.f_back
        return False

    def tracer(frame, event, arg):
        if frame.f_code is learn_code:
            return in_learn
        if state["on"]:
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and str(path) != IMPORT_MACHINERY and not in_network(frame):
                files.add(path.relative_to(ROOT).as_posix())
        return None

    opt = trainer.optimizer
    real_step = opt.step

    def step(*args, **kwargs):
        state["on"], state["done"] = False, True
        sys.settrace(None)
        return real_step(*args, **kwargs)

    opt.step = step
    sys.settrace(tracer)
    try:
        trainer.learn(trajs)
    finally:
        sys.settrace(None)
        del opt.step
    assert state["done"], "the policy optimizer never stepped"
    return files | {"train/trainer.py"}
