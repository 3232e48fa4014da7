"""Learning curves from ``metrics.jsonl`` (matplotlib, Agg backend, no display needed).

:func:`plot_run` writes one PNG per group of metrics present in a run::

    reward.png      keys containing "reward"
    success.png     keys containing "success" (eval points with their Wilson interval when
                    ``<key>_low`` / ``<key>_high`` were logged, e.g. eval/success_low)
    kl.png          keys with a "kl" word (kl, kl/k3, approx_kl, ...)
    clip.png        keys with a component starting with "clip_frac" (by sign and side)
    length.png      "len/*" and keys containing "length"
    loss.png        keys containing "loss"
    entropy.png     keys containing "entropy"
    throughput.png  tokens/s and other throughput keys
    other-N.png     every remaining numeric key, one panel each

Records of a kind other than "train" are labelled by their kind: ``success`` logged with
kind "eval" becomes ``eval/success``, and ``eval/success`` logged with kind "eval_before"
becomes ``eval_before/success`` (see ``_label``). Held-out series (``eval*/``, ``test/``,
``val/``) are drawn as points-and-lines. The x-axis is the training step.

:func:`plot_compare` overlays one metric from several runs against the step or the
logged wall-clock time (to compare algorithms at equal compute).

Figures are built with :class:`matplotlib.figure.Figure` and an Agg canvas, never with
pyplot, so the global backend of an interactive session is untouched.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..train.metrics import RESERVED_KEYS, read_metrics

__all__ = ["plot_run", "plot_compare", "GROUPS"]

Series = Dict[str, List[Tuple[float, float]]]

_WORDS = re.compile(r"[/_\-. ]+")


def _words(key: str) -> List[str]:
    return [w for w in _WORDS.split(key.lower()) if w]


def _is_kl(key: str) -> bool:
    return any(w == "kl" or w.startswith("kl") and w[2:].isdigit() for w in _words(key))


def _is_clip(key: str) -> bool:
    return any(part.startswith("clip_frac") for part in key.lower().split("/"))


def _is_length(key: str) -> bool:
    k = key.lower()
    return k.startswith("len/") or "/len/" in k or "length" in k


def _is_throughput(key: str) -> bool:
    k = key.lower()
    return any(s in k for s in ("tokens_per_s", "tokens/s", "tok/s", "tok_per_s", "throughput", "samples_per_s"))


# (file stem, title, y label, predicate on the key without its eval/ prefix)
GROUPS: Sequence[Tuple[str, str, str, Callable[[str], bool]]] = (
    ("reward", "Reward", "reward", lambda k: "reward" in k.lower()),
    ("success", "Success rate", "success rate", lambda k: "success" in k.lower()),
    ("kl", "KL divergence", "KL (nats)", _is_kl),
    ("clip", "Clip fractions (by advantage sign and side)", "fraction of tokens", _is_clip),
    ("length", "Response length", "tokens", _is_length),
    ("loss", "Loss", "loss", lambda k: "loss" in k.lower() or "nll" in _words(k)),
    ("entropy", "Entropy", "nats / token", lambda k: "entropy" in k.lower()),
    ("throughput", "Throughput", "tokens / s", _is_throughput),
)
_PANELS_PER_OTHER_FIGURE = 9


def _number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)  # NaN / inf kept: matplotlib leaves a gap


def _label(kind: str, key: str) -> str:
    """Series name of ``key`` in a record of ``kind``.

    train records keep their keys; other kinds prefix theirs ("success" logged with kind
    "eval" -> "eval/success"); a key whose namespace the kind refines takes the kind
    ("eval/success" logged with kind "eval_before" -> "eval_before/success"), so that
    evaluations logged at the same step under different kinds stay separate series.
    """
    if kind == "train" or key.startswith(kind + "/"):
        return key
    if "/" in key:
        namespace, rest = key.split("/", 1)
        if kind.startswith(namespace):
            return f"{kind}/{rest}"
    return f"{kind}/{key}"


def _series(records: List[dict], x: str = "step", where: str = "run_dir") -> Series:
    """label -> [(x, value)] sorted by x, the last record winning on duplicate x."""
    table: Dict[str, Dict[float, float]] = {}
    for record in records:
        xv = record.get(x)
        if isinstance(xv, bool) or not isinstance(xv, (int, float)):
            if x == "step":
                continue
            raise ValueError(f"{where}: a record has no numeric {x!r}")
        kind = str(record.get("kind", "train"))
        for key, value in record.items():
            if key in RESERVED_KEYS:
                continue
            number = _number(value)
            if number is None:
                continue
            table.setdefault(_label(kind, key), {})[float(xv)] = number
    return {label: sorted(points.items()) for label, points in table.items()}


_EVAL_WORDS = ("eval", "test", "val", "valid", "validation", "heldout")


def _is_eval(label: str) -> bool:
    """Held-out series ("eval/...", "eval_before/...", "test/..."): drawn as points."""
    return "/" in label and re.split(r"[_\-]", label.split("/", 1)[0])[0] in _EVAL_WORDS


def _base(label: str) -> str:
    return label.split("/", 1)[1] if _is_eval(label) else label


def _bands(series: Series) -> Dict[str, Tuple[str, str]]:
    """label -> (low label, high label) for every label logged with its interval."""
    out = {}
    for label in series:
        low, high = f"{label}_low", f"{label}_high"
        if low in series and high in series:
            out[label] = (low, high)
    return out


def _smooth(values: List[float], weight: float) -> List[float]:
    """Debiased exponential moving average (TensorBoard's smoothing)."""
    if weight <= 0.0:
        return list(values)
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        acc = weight * acc + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(acc / norm)
    return out


def _check_smoothing(smoothing) -> float:
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not (0.0 <= smoothing < 1.0):
        raise ValueError(f"smoothing: must lie in [0, 1), got {smoothing!r}")
    return float(smoothing)


def _new_figure(nrows: int = 1, ncols: int = 1, size=(7.0, 4.2)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _draw(ax, label: str, points, series: Series, bands, smoothing: float, name: Optional[str] = None) -> None:
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    shown = name or label
    if _is_eval(label) or len(points) == 1:
        line = ax.plot(xs, ys, "o-", label=shown, markersize=4)[0]
    elif smoothing > 0.0:
        faint = ax.plot(xs, ys, alpha=0.25, linewidth=1)[0]
        line = ax.plot(xs, _smooth(ys, smoothing), color=faint.get_color(), label=shown)[0]
    else:
        line = ax.plot(xs, ys, label=shown, linewidth=1.3)[0]
    if label in bands:
        low = dict(series[bands[label][0]])
        high = dict(series[bands[label][1]])
        common = [x for x in xs if x in low and x in high]
        if common:
            lo = [low[x] for x in common]
            hi = [high[x] for x in common]
            if _is_eval(label) or len(common) < 3:
                mid = dict(points)
                ax.errorbar(
                    common,
                    [mid[x] for x in common],
                    yerr=[[max(0.0, mid[x] - l) for x, l in zip(common, lo)], [max(0.0, h - mid[x]) for x, h in zip(common, hi)]],
                    fmt="none",
                    ecolor=line.get_color(),
                    capsize=3,
                    alpha=0.8,
                )
            else:
                ax.fill_between(common, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)  # a viewer never sees a half-written PNG
    return path


def plot_run(run_dir, *, out_dir=None, smoothing: float = 0.0) -> List[Path]:
    """Write the learning curves of a run as PNG files and return their paths.

    Args:
      run_dir: run directory holding ``metrics.jsonl`` (written by
        :class:`~trajgrad.train.metrics.MetricsLogger`).
      out_dir: where to write (default ``run_dir/plots``).
      smoothing: exponential-moving-average weight in [0, 1) for train curves (the raw
        curve stays visible, faint); 0 draws the raw values only.

    Raises ValueError naming ``run_dir`` when it or its metrics are missing, or when no
    record holds a numeric metric.
    """
    smoothing = _check_smoothing(smoothing)
    if not isinstance(run_dir, (str, os.PathLike)):
        raise ValueError(f"run_dir: expected a path, got {type(run_dir).__name__}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run_dir: {run_dir} is not a directory")
    records = read_metrics(run_dir)
    series = _series(records)
    if not series:
        raise ValueError(f"run_dir: {run_dir} has no numeric metrics to plot")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    bands = _bands(series)
    interval_labels = {lbl for pair in bands.values() for lbl in pair}
    labels = [lbl for lbl in sorted(series) if lbl not in interval_labels]

    assigned: Dict[str, List[str]] = {}
    rest: List[str] = []
    for label in labels:
        for stem, _, _, predicate in GROUPS:
            if predicate(_base(label)):
                assigned.setdefault(stem, []).append(label)
                break
        else:
            rest.append(label)

    written: List[Path] = []
    for stem, title, ylabel, _ in GROUPS:
        group = assigned.get(stem)
        if not group:
            continue
        fig, (ax,) = _new_figure()
        for label in group:
            _draw(ax, label, series[label], series, bands, smoothing)
        ax.set_title(f"{title} — {run_dir.name}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if stem == "success" and all(0.0 <= v <= 1.0 for lbl in group for _, v in series[lbl]):
            ax.set_ylim(-0.03, 1.03)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="best")
        written.append(_save(fig, out / f"{stem}.png"))

    for index in range(0, len(rest), _PANELS_PER_OTHER_FIGURE):
        chunk = rest[index : index + _PANELS_PER_OTHER_FIGURE]
        ncols = min(3, len(chunk))
        nrows = math.ceil(len(chunk) / ncols)
        fig, axes = _new_figure(nrows, ncols, size=(4.6, 3.2))
        for ax, label in zip(axes, chunk):
            _draw(ax, label, series[label], series, bands, smoothing)
            ax.set_title(label, fontsize="medium")
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
        for ax in axes[len(chunk) :]:
            ax.set_visible(False)
        fig.suptitle(f"Other metrics — {run_dir.name}")
        written.append(_save(fig, out / f"other-{index // _PANELS_PER_OTHER_FIGURE + 1}.png"))
    return written


def plot_compare(
    runs: Mapping[str, os.PathLike],
    key: str,
    out_path,
    x: str = "wall_time",
    *,
    smoothing: float = 0.0,
    title: Optional[str] = None,
) -> Path:
    """Overlay metric ``key`` of several runs in one PNG and return its path.

    Args:
      runs: legend name -> run directory (or metrics.jsonl file).
      key: the metric, as it appears in :func:`plot_run` legends: ``"reward/mean"`` for a
        train key, ``"eval/success"`` for the key ``success`` logged with kind "eval" (or
        logged directly as ``eval/success``), ``"eval_during/success"`` for
        ``eval/success`` logged with kind "eval_during". Its ``_low`` / ``_high`` interval
        is drawn when present.
      out_path: the PNG to write (parent directories are created).
      x: ``"wall_time"`` (seconds of logging, continued across resumes: compares
        algorithms at equal wall-clock) or ``"step"``.
      smoothing: exponential-moving-average weight in [0, 1).
      title: figure title (default: the key).

    Raises ValueError naming ``runs`` when it is empty or a run lacks ``key``.
    """
    if x not in ("wall_time", "step"):
        raise ValueError(f"x: must be 'wall_time' or 'step', got {x!r}")
    smoothing = _check_smoothing(smoothing)
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError("runs: expected a non-empty dict of name -> run directory")
    if not isinstance(key, str) or not key:
        raise ValueError(f"key: expected a metric name, got {key!r}")
    if not isinstance(out_path, (str, os.PathLike)):
        raise ValueError(f"out_path: expected a path, got {type(out_path).__name__}")

    loaded = []
    for name, path in runs.items():
        try:
            records = read_metrics(path)
        except ValueError as exc:
            raise ValueError(f"runs: {name!r}: {exc}") from None
        series = _series(records, x=x, where=f"runs: {name!r}")
        if key not in series:
            raise ValueError(f"runs: {name!r} has no metric {key!r} (has {sorted(series)[:10]}...)")
        loaded.append((str(name), series))

    fig, (ax,) = _new_figure(size=(7.5, 4.5))
    for name, series in loaded:
        _draw(ax, key, series[key], series, _bands(series), smoothing, name=name)
    ax.set_title(title or key)
    ax.set_xlabel("wall-clock time (s)" if x == "wall_time" else "step")
    ax.set_ylabel(key)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    return _save(fig, Path(out_path))
