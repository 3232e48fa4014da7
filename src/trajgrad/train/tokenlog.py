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
  (:mod:`trajgrad.correction`), present only when the recipe sets ``rollout_correction``.

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
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

__all__ = ["TOKENS_FILE", "TokenLog", "StepRecord", "active", "recording", "read_token_log"]

TOKENS_FILE = "tokens.jsonl"
_ACTIVE: contextvars.ContextVar[Optional["StepRecord"]] = contextvars.ContextVar("trajgrad_token_record",
                                                                                  default=None)


def _num(x: float) -> Optional[float]:
    return float(f"{x:.6g}") + 0.0 if math.isfinite(x) else None  # + 0.0: no "-0.0"


def _floats(t: torch.Tensor) -> List[Optional[float]]:
    return [_num(float(x)) for x in t.detach().to(torch.float64).cpu().tolist()]


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


class StepRecord:
    """The per-token values of one policy update, collected micro-batch by micro-batch."""

    def __init__(self, batch, *, step: int, learner_version: int):
        self.batch = batch
        self.step = int(step)
        self.learner_version = int(learner_version)
        self.rows: Dict[int, Dict[str, Any]] = {}

    def add(self, objective, mb, idx, logp: torch.Tensor, entropy: Optional[torch.Tensor], advantages: torch.Tensor,
            old_logp: torch.Tensor, behaviour_logp: Optional[torch.Tensor], *, epoch: int) -> None:
        """Record one micro-batch after its backward pass (``logp.grad`` retained).

        ``advantages``, ``old_logp``, ``behaviour_logp`` are the micro-batch's tensors exactly as
        handed to :meth:`Objective.policy_loss`; the ratio's log-probs and the correction are
        chosen from them the way ``policy_loss`` chooses them.
        """
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
                          advantages=advantages if rc.seq_mask_delta is not None else None)
            keep = mask if corr is None else corr.keep.bool()
            zero = mask & keep & (adv != 0) & (grad == 0)
            for r, b in enumerate(idx):
                m = mask[r]
                row = {
                    "step": self.step, "episode_id": self.batch.episode_ids[b], "segment": int(self.batch.segments[b]),
                    "learner_version": self.learner_version, "epoch": int(epoch), "n": int(m.sum()),
                    "adv": _floats(adv[r][m]), "logp": _floats(lp[r][m]), "old": _floats(old_logp[r][m].double()),
                    "ratio": None if ratio is None else _floats(ratio[r][m]), "grad": _floats(grad[r][m]),
                    "zero_grad": [int(x) for x in zero[r][m].tolist()],
                }
                if entropy is not None:
                    row["entropy"] = _floats(entropy[r][m])
                if corr is not None:
                    row["is_weight"] = _floats(corr.weight[r][m])
                    row["rc_keep"] = [int(x) for x in corr.keep[r][m].tolist()]
                self.rows[b] = row  # a later epoch replaces an earlier one

    def lines(self, epochs: int) -> List[bytes]:
        out = []
        for b in sorted(self.rows):
            row = dict(self.rows[b], epochs=int(epochs))
            out.append((json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n").encode())
        return out


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


@contextlib.contextmanager
def recording(trainer, batch) -> Iterator[Optional[StepRecord]]:
    """Record the per-token values of the policy update run inside the block.

    The update's step is ``trainer.step + 1`` (the number ``metrics.jsonl`` gives it) and the
    learner's policy version ``trainer.policy_version`` (before the update). Does nothing when
    ``log.token_log`` is off or the log is capped. The lines are written when the block exits
    without an exception.
    """
    log = _trainer_log(trainer)
    if log is None or log.capped:
        yield None
        return
    rec = StepRecord(batch, step=trainer.step + 1, learner_version=trainer.policy_version)
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)
    log.write(rec.lines(trainer.learner.epochs_per_batch), rec.step)
