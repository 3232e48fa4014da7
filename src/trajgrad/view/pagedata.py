"""The data a ``trajgrad view`` page embeds: episode rows, token detail, curves, objective.

:func:`page_data` turns a :class:`~trajgrad.view.rundir.RunFiles` into one JSON-ready dict:

* ``rows``: one per trajectory (a sub-trace of an episode, §19): step, reward, success,
  turns, length, action tokens, sampling policy versions, lag, status;
* ``detail``: for each embedded trajectory, its token ids with their role (prompt / action /
  observation), turn boundaries (tool call, tool result, reward, policy version) and, per
  action token, the channels the page colours by (:data:`CHANNELS`);
* ``vocab``: ``{id: text}`` for the ids of the embedded detail (empty without a tokenizer);
* ``curves``: ``{metric: [[step, value], ...]}`` from ``metrics.jsonl`` (eval metrics under
  ``eval/``);
* ``objective``: ``trajgrad.explain.explain`` of the run's objective, from its config;
* ``caps``: what was left out (see below), and ``notes``: what was missing.

**Caps.** A page holds at most ``max_episodes`` rows (the newest trajectories) and token
detail for as many of them, newest first, as fit in ``max_tokens`` tokens; curves keep at
most ``max_points`` points per metric (evenly thinned). The page says so. ``--serve`` fetches
the detail of the other rows from the loopback server on demand (:func:`episode_detail`).

**Step and lag.** A trained trajectory's step is the optimizer step of the update that
trained it (the number ``metrics.jsonl`` gives it) and its lag the learner's policy version at
that update minus the oldest version that sampled one of its turns (§16), both from the token
log. Without a token record the step is estimated as newest sampling version + 1 (exact for
the synchronous trainer, which samples each step with the current policy) and the lag is
unknown.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from ..rollout.trajectory import Trajectory
from ..train.config import build_config
from ..train.mixture import explain_config
from .rundir import RunFiles
from .text import build_tokenizer, token_texts

__all__ = ["CHANNELS", "page_data", "detail_lookup", "episode_detail", "objective_text"]

#: per-action-token channels of the detail, with the page's label for each
CHANNELS = {
    "adv": "advantage A",
    "ratio": "ratio π_θ / π_ratio",
    "is_weight": "rollout-correction IS weight",
    "zero_grad": "clipped / masked (no gradient)",
    "rc_keep": "kept by the rollout correction",
    "grad": "gradient weight −∂L/∂log π_θ",
    "mismatch": "log π_old − log μ (learner vs sampler)",
    "logp": "learner log π_θ",
    "old": "old log π_old",
    "behaviour": "behaviour log μ (sampler)",
    "entropy": "entropy H",
}
_TOKEN_FIELDS = ("adv", "logp", "old", "ratio", "grad", "zero_grad", "entropy", "is_weight", "rc_keep")
_CURVE_SKIP = ("time/", "throughput/")


def _finite(x) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def objective_text(config: Optional[Dict[str, Any]]) -> str:
    """``explain`` of the run's objective (its config's recipe and overrides), or why not."""
    if config is None:
        return "(no config.json in the run directory: the objective is unknown)"
    try:
        return explain_config(build_config(config))
    except Exception as exc:  # an old or foreign config: say so on the page
        return f"(the run's config does not build an objective here: {' '.join(str(exc).split())[:300]})"


def _status(t: Trajectory, rec: Optional[Dict[str, Any]], token_log: bool) -> str:
    md = t.metadata or {}
    if md.get("discarded"):
        return f"discarded ({md['discarded']})"
    a = md.get("async")
    if isinstance(a, dict) and a.get("status") and a.get("status") != "trained":
        return str(a["status"])
    if md.get("demonstration"):
        return "demonstration"
    if rec is not None:
        return "trained"
    return "no token record" if token_log else "—"


def _row(k: int, t: Trajectory, rec: Optional[Dict[str, Any]], token_log: bool) -> Dict[str, Any]:
    versions = [turn.policy_version for turn in t.turns]
    vmin = min(versions) if versions else None
    vmax = max(versions) if versions else None
    if rec is not None:
        step, src = int(rec["step"]), "token log"
        lag = int(rec.get("learner_version", 0)) - vmin if vmin is not None else None
    else:
        step, src, lag = (vmax + 1 if vmax is not None else None), "estimated", None
    text = " ".join(turn.action_text for turn in t.turns)
    return {
        "i": k, "id": t.episode_id, "seg": t.segment, "task": t.task_id, "split": t.split,
        "step": step, "step_src": src, "reward": _finite(t.total_reward), "success": t.success,
        "turns": len(t.turns), "len": len(t), "act": t.num_action_tokens, "vmin": vmin, "vmax": vmax, "lag": lag,
        "status": _status(t, rec, token_log), "terminated": t.terminated, "truncated": t.truncated,
        "env": str((t.metadata or {}).get("environment") or ""),
        "search": f"{t.episode_id} {t.task_id} {text}"[:600].lower(),
    }


def episode_detail(t: Trajectory, rec: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """One trajectory's tokens: ids, roles (0 prompt, 1 action, 2 observation), turns, channels."""
    ids = t.token_ids()
    role = [0] * len(t.prompt_ids)
    turn_of = [-1] * len(t.prompt_ids)
    turns = []
    pos = len(t.prompt_ids)
    for k, turn in enumerate(t.turns):
        a, o = len(turn.action_ids), len(turn.observation_ids)
        info = turn.info or {}
        turns.append({
            "k": k, "start": pos, "obs": pos + a, "end": pos + a + o, "reward": _finite(turn.reward),
            "version": turn.policy_version, "cut": turn.cut, "tool": info.get("tool"),
            "tool_error": info.get("tool_error"), "text": turn.action_text[:2000],
        })
        role += [1] * a + [2] * o
        turn_of += [k] * (a + o)
        pos += a + o
    ch: Dict[str, List[Any]] = {"behaviour": [x for turn in t.turns for x in turn.behaviour_logp]}
    n = t.num_action_tokens
    if rec is not None and int(rec.get("n", -1)) == n:
        for f in _TOKEN_FIELDS:
            if isinstance(rec.get(f), list) and len(rec[f]) == n:
                ch[f] = rec[f]
        if "old" in ch:
            ch["mismatch"] = [None if o is None else round(o - b, 6) for o, b in zip(ch["old"], ch["behaviour"])]
    out = {"ids": ids, "role": role, "turn": turn_of, "turns": turns, "ch": ch, "n_action": n}
    if rec is not None:
        out["step"] = rec.get("step")
        out["epoch"] = rec.get("epoch")
        out["epochs"] = rec.get("epochs")
    return out


def _curves(metrics: List[Dict[str, Any]], max_points: int) -> Dict[str, List[List[float]]]:
    series: Dict[str, List[List[float]]] = {}
    for r in metrics:
        kind = r.get("kind", "train")
        step = _finite(r.get("step"))
        if step is None:
            continue
        for key, v in r.items():
            if key in ("step", "kind", "time", "wall_time") or isinstance(v, bool) or key.startswith(_CURVE_SKIP):
                continue
            x = _finite(v) if isinstance(v, (int, float)) else None
            if x is None:
                continue
            name = key if kind == "train" or key.startswith(kind + "/") else f"{kind}/{key}"
            series.setdefault(name, []).append([step, x])
    for name, pts in series.items():
        if len(pts) > max_points:
            stride = len(pts) / max_points
            series[name] = [pts[int(i * stride)] for i in range(max_points - 1)] + [pts[-1]]
    return series


def _selected(run: RunFiles, max_episodes: int):
    """The newest ``max_episodes`` trajectories and their last token-log record (or None)."""
    trajs = [t for _, _, t in run.trajectories][-max_episodes:] if max_episodes else []
    return trajs, [(run.tokens.get((t.episode_id, t.segment)) or [None])[-1] for t in trajs]


def detail_lookup(run: RunFiles, *, max_episodes: int = 5000):
    """``lookup(k) -> {"detail": ..., "vocab": ...}`` for row ``k`` of the page (``--serve``);
    raises ``KeyError`` for a row that does not exist."""
    trajs, recs = _selected(run, max_episodes)
    state: Dict[str, Any] = {}

    def lookup(k: int) -> Dict[str, Any]:
        if not 0 <= k < len(trajs):
            raise KeyError(k)
        if "tok" not in state:
            state["tok"] = build_tokenizer(run.config)[0]
        d = episode_detail(trajs[k], recs[k])
        tok = state["tok"]
        vocab = {str(i): s for i, s in token_texts(tok, d["ids"]).items()} if tok is not None else {}
        return {"detail": d, "vocab": vocab}

    return lookup


def page_data(run: RunFiles, *, max_episodes: int = 5000, max_tokens: int = 300_000, max_points: int = 2000,
              serve: bool = False) -> Dict[str, Any]:
    """The page's data (see the module docstring); ``serve``: the page may fetch the rest."""
    for name, v in (("max_episodes", max_episodes), ("max_tokens", max_tokens), ("max_points", max_points)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "max_points" else 0):
            raise ValueError(f"{name}: expected a non-negative integer, got {v!r}")
    trajs, recs = _selected(run, max_episodes)
    token_log = bool(run.tokens) or run.token_log_capped_at is not None
    rows = [_row(k, t, rec, token_log) for k, (t, rec) in enumerate(zip(trajs, recs))]
    detail: Dict[str, Any] = {}
    budget = max_tokens
    for k in range(len(trajs) - 1, -1, -1):
        n = len(trajs[k])
        if n > budget:
            break
        budget -= n
        detail[str(k)] = episode_detail(trajs[k], recs[k])
    tokenizer, tok_note = build_tokenizer(run.config)
    vocab: Dict[str, str] = {}
    if tokenizer is not None:
        ids = set()
        for d in detail.values():
            ids.update(d["ids"])
        vocab = {str(i): s for i, s in token_texts(tokenizer, ids).items()}
    caps = {
        "trajectories_total": run.total_trajectories, "rows": len(rows), "max_episodes": max_episodes,
        "detail": len(detail), "max_tokens": max_tokens, "max_points": max_points,
        "token_log_capped_at": run.token_log_capped_at,
    }
    cfg = run.config or {}
    return {
        "run": {"path": str(run.path), "name": cfg.get("name"), "model": (cfg.get("model") or {}).get("name"),
                "recipe": (cfg.get("recipe") or {}).get("name")},
        "rows": rows, "detail": detail, "vocab": vocab, "channels": CHANNELS,
        "curves": _curves(run.metrics, max_points), "objective": objective_text(run.config),
        "caps": caps, "notes": list(run.notes) + [tok_note], "serve": bool(serve), "has_tokenizer": tokenizer is not None,
    }
