r"""The per-token sidecar log ``tokens.jsonl``: what each policy update did to each action token.

``trajgrad view`` colours an episode's tokens by what the loss saw. The trainer writes, for
every trajectory of every policy update, one JSON line keyed by ``(episode_id, segment,
step)``::

    {"step": 3, "episode_id": "calc-17#2-5", "segment": 0, "learner_version": 2,
     "epoch": 0, "epochs": 1, "n": 14,
     "adv": [...], "logp": [...], "old": [...], "ratio": [...], "grad": [...],
     "zero_grad": [...], "entropy": [...], "is_weight": [...], "rc_keep": [...]}

Every list has one value per *action* token of the trajectory, in order (``n`` of them):

* ``adv``: the advantage the loss received (a per-response advantage repeated at each token);
* ``logp``: :math:`\log\pi_\theta(y_t)`, the learner log-prob the loss differentiated;
* ``old``: the old (proximal) log-prob handed to the loss as ``old_logp``;
* ``ratio``: :math:`\exp(\log\pi_\theta-\mathrm{sg}[\log\pi_{ratio}])`, the per-token ratio to
  the log-probs the term takes its ratio against (``old`` or the sampler's, by the term's
  declared ``ratio``; rollout correction in bypass mode uses the sampler's), ``null`` for a
  term without a ratio; sequence terms (GSPO) form their ratio from these;
* ``grad``: :math:`-\partial\mathcal L/\partial\log\pi_\theta(y_t)`, read from autograd after
  the micro-batch's backward pass: the exact weight the step gave the token (positive:
  pushed up), KL and entropy terms included;
* ``zero_grad``: 1 where the advantage is non-zero, the rollout correction kept the token,
  and the loss still gave it no gradient: clipped or masked by the trust region;
* ``entropy``: the per-token entropy of the sampling distribution, when computed;
* ``is_weight`` / ``rc_keep``: the rollout correction's detached weight and keep flag
  (:mod:`trajgrad.logprobs.correction`), present only when the recipe sets ``rollout_correction``.

The values are the tensors of the update (the same advantages, log-probs and masks the loss
got); floats are rounded to 6 significant digits, non-finite ones written as ``null``. With
``epochs_per_batch > 1`` the line describes the last epoch (the most off-policy one).

**Bounded.** ``log.token_log`` (default true) turns the log on; once the file reaches
``log.token_log_max_mb`` (default 64 MB) nothing more is written and one last line
``{"step": s, "capped": true, "max_bytes": ...}`` says from which step the log is missing.
Each update's lines are appended with one write, flushed and ``fsync``'d, like the other logs;
a torn last line is dropped, and a resumed run drops the lines of the steps it replays.
One file per rank (``tokens.rank{r}.jsonl`` when there are several).
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

__all__ = ["TOKENS_FILE", "TokenLog", "StepRecord", "active", "finish", "recording", "read_token_log", "start"]

TOKENS_FILE = "tokens.jsonl"
_ACTIVE: contextvars.ContextVar[Optional["StepRecord"]] = contextvars.ContextVar("trajgrad_token_record",
                                                                                  default=None)


def _num(x: float) -> Optional[float]:
    return float(f"{x:.6g}") + 0.0 if math.isfinite(x) else None  # + 0.0: no "-0.0"


_G6 = "{:.6g}".format


def _format6(v: torch.Tensor) -> List[str]:
    """``json.dumps(_num(x))`` of every value of the 1-D float64 tensor ``v``, batched.

    ``format(x, ".6g")`` is already the shortest ``repr`` of the rounded value for a normal
    ``x`` (two decimals of <= 15 significant digits are never the same double), except where
    ``repr`` differs from ``%g``: an integral value ("1" -> "1.0", "-0" -> "0.0"; a value
    rounds to an integer only if it lies within ``5e-6 |x|`` of one), ``|x| >= 1e6``
    (positional up to 1e16), non-finite (``null``), subnormal values. Those, flagged below
    (a superset), take the per-value path.
    """
    a = v.abs()
    flag = ~(a < 1e5) | (a < 2.2250738585072014e-308) | ((a >= 0.5) & ((v - v.round()).abs() <= 1e-5 * a))
    vals = v.tolist()
    out = list(map(_G6, vals))
    for i in flag.nonzero().flatten().tolist():
        s = out[i]
        if s.lstrip("-").isdigit():  # an integer below 1e6: repr appends ".0"
            out[i] = "0.0" if s == "-0" else s + ".0"
        else:
            out[i] = json.dumps(_num(vals[i]), allow_nan=False)
    return out


def _row_lists(t: torch.Tensor, mask: torch.Tensor, ends: List[int]) -> List[str]:
    """The JSON list of each row's values at ``mask`` (rows in order; ``ends``: cumulative counts)."""
    out = _format6(t.detach().to(torch.float64)[mask].cpu())
    return ["[" + ",".join(out[s:e]) + "]" for s, e in zip([0] + ends[:-1], ends)]


def _row_ints(t: torch.Tensor, mask: torch.Tensor, ends: List[int]) -> List[str]:
    """``json.dumps([int(x) for x in row])`` of each row's values at ``mask``."""
    vals = t[mask].tolist()
    return ["[" + ",".join(map(str, map(int, vals[s:e]))) + "]" for s, e in zip([0] + ends[:-1], ends)]


def _lines(path: Path) -> Iterator[tuple]:
    """(end offset, parsed record) of every complete line."""
    end = 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                return
            end += len(line)
            try:
                rec = json.loads(line)
            except ValueError:
                return  # a damaged line: keep what precedes it
            yield end, rec


def read_token_log(path) -> List[Dict[str, Any]]:
    """Every complete record of a token log (a torn or damaged tail is ignored)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [rec for _, rec in _lines(path) if isinstance(rec, dict)]


_INT_KEYS = ("zero_grad", "rc_keep")


def token_values(objective, mb, logp: torch.Tensor, entropy: Optional[torch.Tensor], advantages: torch.Tensor,
                 old_logp: torch.Tensor, behaviour_logp: Optional[torch.Tensor]):
    """``(mask, {key: [R, T] tensor or None})``: the per-token columns of one micro-batch, keys
    in the line's order (``entropy``, ``is_weight`` / ``rc_keep`` only when present); the
    ratio's log-probs and the correction are chosen the way ``policy_loss`` chooses them."""
    with torch.no_grad():
        mask = mb.action_mask.bool()
        lp = logp.detach().double()
        grad = logp.grad
        grad = torch.zeros_like(lp) if grad is None else -grad.detach().double()
        adv = advantages.detach().double()
        if adv.ndim == 1:
            adv = adv[:, None].expand_as(lp)
        rc = objective.rollout_correction
        bypass = bool(rc) and rc.mode == "bypass"
        ratio_src = objective.ratio_source
        if ratio_src == "old" and not bypass:
            ratio_logp = old_logp
        elif ratio_src != "none":
            ratio_logp = behaviour_logp if behaviour_logp is not None else old_logp
        else:
            ratio_logp = None
        ratio = None
        if ratio_logp is not None:
            ratio = torch.exp(torch.where(mask, lp - ratio_logp.detach().double(), torch.zeros_like(lp)))
        corr = None
        if rc and behaviour_logp is not None:
            target = lp if bypass else old_logp.detach()
            corr = rc(behaviour_logp, target, mb.action_mask,
                      advantages=advantages if rc.seq_mask_delta is not None else None, current_logp=lp)
        keep = mask if corr is None else corr.keep.bool()
        zero = mask & keep & (adv != 0) & (grad == 0)
        values = {"adv": adv, "logp": lp, "old": old_logp.double(), "ratio": ratio, "grad": grad, "zero_grad": zero}
        if entropy is not None:
            values["entropy"] = entropy
        if corr is not None:
            values["is_weight"] = corr.weight
            values["rc_keep"] = corr.keep
    return mask, values


class StepRecord:
    """The per-token values of one policy update, collected micro-batch by micro-batch."""

    def __init__(self, batch, *, step: int, learner_version: int):
        self.batch = batch
        self.step = int(step)
        self.learner_version = int(learner_version)
        self.rows: Dict[int, str] = {}  # batch row -> its line, without ``epochs`` and the closing brace

    def add(self, objective, mb, idx, logp: torch.Tensor, entropy: Optional[torch.Tensor], advantages: torch.Tensor,
            old_logp: torch.Tensor, behaviour_logp: Optional[torch.Tensor], *, epoch: int) -> None:
        """Record one micro-batch after its backward pass (``logp.grad`` retained).

        ``advantages``, ``old_logp``, ``behaviour_logp`` are the micro-batch's tensors exactly as
        handed to :meth:`Objective.policy_loss` (see :func:`token_values`). Each column is
        formatted at once (:func:`_format6`), then cut into rows.
        """
        mask, values = token_values(objective, mb, logp, entropy, advantages, old_logp, behaviour_logp)
        counts = mask.sum(1).tolist()
        ends = list(itertools.accumulate(counts))
        cols = {k: None if v is None else (_row_ints if k in _INT_KEYS else _row_lists)(v, mask, ends)
                for k, v in values.items()}
        dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
        for r, b in enumerate(idx):
            head = {"step": self.step, "episode_id": self.batch.episode_ids[b], "segment": int(self.batch.segments[b]),
                    "learner_version": self.learner_version, "epoch": int(epoch), "n": int(counts[r])}
            # the JSON object without its closing brace (``lines`` appends "epochs"); a later
            # epoch replaces an earlier one
            self.rows[b] = dumps(head)[:-1] + "".join(
                f',"{k}":' + ("null" if c is None else c[r]) for k, c in cols.items())

    def lines(self, epochs: int) -> List[bytes]:
        """One JSON line per recorded trajectory, in batch order (keys as in the module docstring)."""
        tail = f',"epochs":{int(epochs)}}}\n'
        return [(self.rows[b] + tail).encode() for b in sorted(self.rows)]


class TokenLog:
    """Append-only, size-capped ``tokens.jsonl`` (see the module docstring).

    Args:
      path: the file.
      max_bytes: stop writing once the file holds this many bytes (a last ``capped`` line
        marks the step).
      start_step: drop the lines of steps ``>= start_step`` already in the file (a resumed
        run replays them) and a torn tail; ``0`` starts an empty log.
    """

    def __init__(self, path, *, max_bytes: int, start_step: int = 0):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes: expected a positive integer, got {max_bytes!r}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.capped = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = 0
        if self.path.exists():
            for end, rec in _lines(self.path):
                if not isinstance(rec, dict) or int(rec.get("step", 0)) >= start_step:
                    break
                keep = end
                self.capped = self.capped or bool(rec.get("capped"))
            if self.path.stat().st_size != keep:
                with open(self.path, "r+b") as fh:
                    fh.truncate(keep)
                    fh.flush()
                    os.fsync(fh.fileno())
        self.size = keep

    def write(self, lines: List[bytes], step: int) -> int:
        """Append one update's lines (one write, one fsync); returns how many were written."""
        if self.capped or not lines:
            return 0
        data = b"".join(lines)
        written = len(lines)
        if self.size + len(data) > self.max_bytes:
            self.capped = True
            data = (json.dumps({"step": int(step), "capped": True, "max_bytes": self.max_bytes}) + "\n").encode()
            written = 0
        with open(self.path, "ab") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        self.size += len(data)
        return written


def active() -> Optional[StepRecord]:
    """The record of the policy update now running, or None (nothing to record)."""
    return _ACTIVE.get()


def _trainer_log(trainer) -> Optional[TokenLog]:
    log = getattr(trainer, "_token_log", None)
    if log is None:
        cfg = trainer.cfg.log
        if not getattr(cfg, "token_log", False):
            return None
        name = TOKENS_FILE if trainer.world == 1 else f"tokens.rank{trainer.rank}.jsonl"
        log = TokenLog(Path(trainer.run_dir) / name, max_bytes=int(cfg.token_log_max_mb * 2**20),
                       start_step=trainer.step + 1)
        trainer._token_log = log
    return log


def start(trainer, batch) -> Optional[StepRecord]:
    """The record of the policy update about to run on ``batch``, or None when ``log.token_log``
    is off or the log is capped. Its step is ``trainer.step + 1`` (the number ``metrics.jsonl``
    gives it), its learner version ``trainer.policy_version`` (before the update)."""
    log = _trainer_log(trainer)
    if log is None or log.capped:
        return None
    return StepRecord(batch, step=trainer.step + 1, learner_version=trainer.policy_version)


def finish(trainer, rec: Optional[StepRecord]) -> None:
    """Append the lines of a finished update's record (nothing for None)."""
    if rec is not None:
        _trainer_log(trainer).write(rec.lines(trainer.learner.epochs_per_batch), rec.step)


@contextlib.contextmanager
def recording(trainer, batch) -> Iterator[Optional[StepRecord]]:
    """Record the per-token values of the policy update run inside the block
    (:func:`trajgrad.train.updates.policy_update` reads :func:`active`).

    The record is that of :func:`start`; the lines are written (:func:`finish`) when the
    block exits without an exception.
    """
    rec = start(trainer, batch)
    if rec is None:
        yield None
        return
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)
    finish(trainer, rec)
