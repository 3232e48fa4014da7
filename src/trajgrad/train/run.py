"""``trajgrad train``: build the config, print the exact objective, train, report held-out success."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

from .config import Config, build_config, load_config


def _console(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 prints
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
) -> int:
    from ..objective import explain

    if resume is not None:
        resume = Path(resume)
        saved = resume / "config.json"
        if not saved.exists():
            raise ValueError(f"resume: {resume} has no config.json (not a trajgrad run directory)")
        data = json.loads(saved.read_text())
        cfg: Config = build_config(data)
        if config is not None or preset is not None or overrides:
            raise ValueError("resume: continue a run with its own saved config (drop CONFIG/--preset/--set)")
        out_dir = resume
    else:
        cfg = load_config(config, preset=preset, overrides=overrides)
        out_dir = Path(run_dir) if run_dir is not None else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    from .trainer import Trainer

    _console(f"run directory: {out_dir}")
    _console("objective optimized by every update of this run:\n")
    _console(explain(cfg.objective()))
    _console("")
    if cfg.asynchronous.enabled:
        from .asynchronous import AsyncTrainer

        trainer = AsyncTrainer(cfg, out_dir, resume=resume is not None, console=_console)
    else:
        trainer = Trainer(cfg, out_dir, resume=resume is not None, console=_console)
    t0 = time.perf_counter()
    summary = trainer.run()
    _console(f"done in {time.perf_counter() - t0:.0f} s; metrics: {out_dir / 'metrics.jsonl'}; "
             f"plots: trajgrad plot {out_dir}")
    return 0
