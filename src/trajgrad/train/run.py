"""``trajgrad train``: build the config, print the exact objective, train, report held-out success."""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from .asynchronous import AsyncTrainer
from .config import Config, load_config
from .config_sources import recipe_defaults_line
from .mixture import explain_config
from .rundir import check_new_run_dir, check_resume, commit_resume, create_run_dir, lock_existing_run_dir
from .trainer import Trainer


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def end_distributed_worker(code: int = 0) -> None:
    """End a worker of a multi-process run (torchrun) whose run finished, without the
    interpreter's teardown.

    The process group's worker threads (gloo's ``pt_gloo_runloop``) release the tensors of
    the last collectives shortly after those complete. A thread that does so while the
    interpreter is finalizing needs the GIL, is stopped inside a C++ destructor, and the
    process aborts (``terminate called without an active exception``, SIGABRT) after a run
    that succeeded (4 of about 200 runs of a 2-rank CPU job on a loaded 2-core machine).
    ``Trainer.finish`` destroys the group, but a group that other modules still hold
    (importing ``torch._dynamo`` after the group exists keeps it) keeps its threads. So the
    worker ends here: everything the run writes is closed by then (``Trainer.finish``),
    and standard output, standard error and the logging handlers are flushed first.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # a closed or replaced stream
            pass
    logging.shutdown()
    os._exit(code)


def _console(msg: str) -> None:
    if _rank() != 0:  # under torchrun only rank 0 prints
        return
    try:
        from rich.console import Console

        Console(highlight=False).print(msg, markup=False)
    except Exception:  # pragma: no cover
        print(msg)


def main(
    *,
    config: Optional[Path] = None,
    preset: Optional[str] = None,
    overrides: Optional[Dict[str, Any]] = None,
    resume: Optional[Path] = None,
    run_dir: Optional[Path] = None,
    overwrite: bool = False,
    allow_config_change: bool = False,
    checkpoint: Optional[str] = None,
) -> int:
    """Validate everything (config, run directory, checkpoint, logs), then train.

    Nothing is created or changed on disk before every check has passed: a new run refuses a
    non-empty ``run_dir`` unless ``overwrite``; a resume (``resume``: the run directory) refuses
    a config that differs from the run's unless ``allow_config_change``, and resumes from
    ``checkpoint`` (a ``step-NNNNNN`` name) when given. See :mod:`trajgrad.train.rundir`.
    The process that writes the run directory (rank 0 under torchrun) holds its lock until
    it ends; a second writer is refused naming the holder (:mod:`trajgrad.train.runlock`).
    Returns 0, or 3 when ``train.stop_on_no_signal`` ended the run early (:mod:`trajgrad.train.learning_signal`).
    """
    locks: list = []  # rank 0's locks on the run directory (see trajgrad.train.runlock)
    try:
        code = _main(locks, config, preset, overrides, resume, run_dir, overwrite, allow_config_change, checkpoint)
    finally:
        for lock in locks:
            if lock is not None:
                lock.release()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        end_distributed_worker(code)  # one of several processes (torchrun): see end_distributed_worker
    return code


def _main(locks, config, preset, overrides, resume, run_dir, overwrite, allow_config_change, checkpoint) -> int:
    """:func:`main`'s body; the run directory's locks are appended to ``locks``."""
    plan = None
    if resume is not None:
        if overwrite:
            raise ValueError("overwrite: --overwrite starts a new run; it cannot be combined with --resume")
        if run_dir is not None and Path(run_dir).resolve() != Path(resume).resolve():
            raise ValueError("run_dir: --resume continues the run in its own directory; drop --run-dir")
        if _rank() == 0:  # under torchrun rank 0 owns (and locks) the run directory
            locks.append(lock_existing_run_dir(resume))  # before reading it: one writer at a time
        plan = check_resume(resume, config=config, preset=preset, overrides=overrides,
                            allow_config_change=allow_config_change, checkpoint=checkpoint)
        cfg: Config = plan.cfg
        out_dir = Path(resume)
    else:
        if allow_config_change:
            raise ValueError("allow_config_change: --allow-config-change only applies with --resume")
        if checkpoint is not None:
            raise ValueError("checkpoint: --checkpoint only applies with --resume")
        cfg = load_config(config, preset=preset, overrides=overrides)
        out_dir = Path(run_dir) if run_dir is not None else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if _rank() == 0:  # under torchrun rank 0 owns (and locks) the run directory
            locks.append(lock_existing_run_dir(out_dir))  # a run still writing there is refused, even with --overwrite
            check_new_run_dir(out_dir, overwrite=overwrite)
    objective_text = explain_config(cfg)  # with tasks: each environment's objective where they differ

    # every check passed: from here on the run directory is written
    new_dir = None
    if _rank() == 0:
        if plan is not None:
            commit_resume(plan)
        else:
            new_dir = create_run_dir(out_dir, cfg, overwrite=overwrite, lock=locks[-1])
            locks.append(new_dir.lock)
    _console(f"run directory: {out_dir}")
    for note in plan.notes if plan is not None else ():
        _console(note)
    _console("objective optimized by every update of this run:\n")
    _console(objective_text)
    _console("")
    _console(recipe_defaults_line(cfg))
    try:
        if cfg.asynchronous.enabled:
            trainer = AsyncTrainer(cfg, out_dir, resume=plan is not None, console=_console)
        else:
            trainer = Trainer(cfg, out_dir, resume=plan is not None, console=_console)
    except BaseException:
        if new_dir is not None:
            new_dir.abandon()  # a start that fails leaves nothing behind (an overwritten run is put back)
        raise
    if new_dir is not None:
        new_dir.keep()
    t0 = time.perf_counter()
    result = trainer.run()
    stopped = result.get("stopped") if isinstance(result, dict) else None
    if stopped:
        _console(f"the run ended at step {result.get('steps')} of {cfg.train.steps}: {stopped}")
    _console(f"done in {time.perf_counter() - t0:.0f} s; metrics: {out_dir / 'metrics.jsonl'}; "
             f"plots: trajgrad plot {out_dir}")
    return 3 if stopped else 0
