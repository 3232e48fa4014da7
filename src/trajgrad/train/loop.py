"""The run's frame, shared by the synchronous and the asynchronous (Ray) runs.

* :func:`preamble`: held-out evaluation before training, the SFT warm start (and the
  evaluation after it), the snapshot of :math:`\\pi_{ref}` (the policy when RL starts), the
  first checkpoint. Skipped by a resumed run, whose checkpoint holds all of it.
* :func:`end_of_step`: count the optimizer step, log its metrics, update the progress bar,
  evaluate and checkpoint on the configured cadence.
* :func:`progress_bar`: the run's tqdm bar (disabled off rank 0 or with ``log.progress`` off).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

from ..stats import two_proportion_test
from .evaluation import format_eval

# live metrics on the progress bar: (metric key, label)
POSTFIX: Tuple[Tuple[str, str], ...] = (
    ("reward/mean", "reward"), ("success/rate", "success"), ("kl/k3", "kl"), ("kl/k3_to_reference", "kl_ref"),
    ("clip_frac/pos_high", "clip+"), ("clip_frac/neg_low", "clip-"), ("entropy", "entropy"),
    ("throughput/gen_tokens_per_s", "tok/s"))


def progress_bar(trainer, total: int, desc: str, initial: int = 0):
    from tqdm.auto import tqdm

    show = trainer.cfg.log.progress and trainer.is_main
    return tqdm(total=total, initial=initial, desc=desc, disable=not show, dynamic_ncols=True)


# checkpoints taken during the SFT warm start (with checkpointing on): about this many
SFT_CHECKPOINTS = 10


def sft_checkpoint_every(cfg) -> int:
    """SFT steps between the warm start's checkpoints (0: none): ``sft.steps`` split into
    about :data:`SFT_CHECKPOINTS` parts, when the run checkpoints at all."""
    if not cfg.checkpoint.every or cfg.sft.steps <= 1:
        return 0
    return max(1, cfg.sft.steps // SFT_CHECKPOINTS)


def preamble(trainer, save: Callable[[], object]) -> None:
    """Before the first RL step of a fresh run. A run resumed after it skips it; a run
    resumed inside the SFT warm start continues the warm start from its checkpoint."""
    cfg = trainer.cfg
    resume_sft = getattr(trainer, "sft_resume", None)
    if trainer.resume and resume_sft is None:
        return
    if cfg.eval.before and not trainer.resume:
        trainer.console(f"evaluating on {len(trainer.heldout_tasks)} held-out tasks (before training)...")
        trainer.eval_before = trainer.evaluate("before")
        trainer.console(format_eval("before", trainer.eval_before))
    if cfg.sft.steps > 0:
        start = int(resume_sft["step"]) if resume_sft else 0
        bar = progress_bar(trainer, cfg.sft.steps, "sft warm start", initial=start)

        def prog(s, loss):
            bar.update(1)
            bar.set_postfix(nll=f"{loss:.3f}")
            trainer.metrics.log(s, {"sft/nll": loss}, kind="sft")

        trainer.sft(cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr, progress=prog, save=save,
                    every=sft_checkpoint_every(cfg), resume=resume_sft)
        trainer.sft_resume = None
        bar.close()
        if cfg.eval.before:
            trainer.console(format_eval("after SFT", trainer.evaluate("after_sft")))
    trainer.snapshot_reference()
    if cfg.checkpoint.every:
        save()


def end_of_step(trainer, metrics: Dict[str, float], save: Callable[[], object], bar=None,
                postfix: Sequence[Tuple[str, str]] = POSTFIX, say_eval: bool = True) -> None:
    """One optimizer step is done: count it, log it, evaluate and checkpoint on cadence."""
    cfg = trainer.cfg
    trainer.step += 1
    watch = getattr(trainer, "signal_watch", None)
    warning = watch.update(metrics) if watch is not None else None
    trainer.metrics.log(trainer.step, metrics, kind="train")
    if bar is not None:
        bar.update(1)
        bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in postfix if k in metrics})
    if warning is not None and trainer.is_main:
        (bar.write if bar is not None and not bar.disable else trainer.console)(f"step {trainer.step}: {warning}")
    if warning is not None and watch.stop:
        trainer.stop_reason = warning
    last = cfg.train.steps if getattr(trainer, "stop_reason", None) is None else trainer.step
    if cfg.eval.every and trainer.step % cfg.eval.every == 0 and trainer.step < last:
        ev = trainer.evaluate("during")
        if say_eval and trainer.is_main:
            write = bar.write if bar is not None and not bar.disable else trainer.console
            write(format_eval(f"at step {trainer.step}", ev))
    if cfg.checkpoint.every and (trainer.step % cfg.checkpoint.every == 0 or trainer.step == last):
        save()


def eval_summary(trainer, summary: Dict, after) -> Optional[float]:
    """Add the before/after comparison to ``summary``; the two-proportion p-value."""
    b = trainer.eval_before
    if b is None:
        return None
    p = two_proportion_test(b.successes, b.n, after.successes, after.n)
    summary["eval_before"] = b.to_dict()
    summary["p_value"] = p
    trainer.console(f"held-out success {b.success:.1%} -> {after.success:.1%} "
                    f"(change {after.success - b.success:+.1%}, two-proportion p = {p:.3g})")
    return p
