"""Experiment trackers as sinks of the metrics log: Weights & Biases, MLflow, trackio.

``run_dir/metrics.jsonl`` (:class:`trajgrad.train.metrics.MetricsLogger`) is the source of
truth: every record is written and ``fsync``-ed there *first*, then handed to each sink
named in ``log.backends``. Nothing leaves the machine:

* ``wandb``: an offline run (``mode="offline"``, ``WANDB_MODE=offline``) under
  ``run_dir/wandb``; ``wandb sync run_dir/wandb/offline-run-*`` uploads it later if wanted.
* ``mlflow``: a local file store ``run_dir/mlruns`` (``MLFLOW_ALLOW_FILE_STORE=true``, the
  opt-in MLflow 3 asks for; read it with :func:`mlflow_client` or browse with
  ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri run_dir/mlruns``).
* ``trackio``: its local database ``<TRACKIO_DIR>/<project>.db``. trackio reads
  ``TRACKIO_DIR`` once, at import: unless it is set, the first run of the process sets it
  to ``run_dir/trackio`` (browse with ``TRACKIO_DIR=run_dir/trackio trackio show``).

A sink that raises at run time is disabled with one warning (the JSONL record, already on
disk, is not lost; :attr:`Sink.error` keeps the reason). A backend whose package is not
installed is refused at config load (:func:`missing_backends`, key ``log.backends``).
Records of kind ``"eval"`` are logged under ``eval/<key>`` (as in TensorBoard).
"""
from __future__ import annotations

import importlib.util
import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Sink", "WandbSink", "MLflowSink", "mlflow_client", "TrackioSink", "SINKS", "PACKAGES", "missing_backends",
           "build_sinks"]

# backend name -> the package that provides it (jsonl and tensorboard are built in)
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def missing_backends(backends: Iterable[str]) -> List[Tuple[str, str]]:
    """``(backend, package)`` for every backend in ``backends`` whose package is not installed."""
    return [(b, PACKAGES[b]) for b in backends if b in PACKAGES and importlib.util.find_spec(PACKAGES[b]) is None]


def _numeric(record: Mapping[str, Any], kind: str) -> Dict[str, float]:
    out = {}
    for key, value in record.items():
        if key in ("step", "kind", "time") or isinstance(value, (str, bool)) or value is None:
            continue
        name = key if kind == "train" or key.startswith(kind + "/") else f"{kind}/{key}"
        out[name] = float(value)
    return out


class Sink:
    """One tracker. Subclasses implement :meth:`_log` and :meth:`_close`."""

    name = "sink"

    def __init__(self) -> None:
        self.error: Optional[str] = None  # why the sink was disabled, if it was

    @property
    def active(self) -> bool:
        return self.error is None

    def log(self, step: int, record: Mapping[str, Any], kind: str) -> None:
        """Send one record (the dict :meth:`MetricsLogger.log` wrote); never raises."""
        if self.error is not None:
            return
        try:
            self._log(int(step), _numeric(record, kind), float(record.get("time", time.time())))
        except Exception as exc:  # a tracker must never stop training or lose the JSONL record
            self.error = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"log.backends: {self.name} disabled after an error ({self.error}); "
                          "metrics.jsonl keeps every record", stacklevel=3)

    def close(self) -> None:
        try:
            self._close()
        except Exception as exc:
            warnings.warn(f"log.backends: closing {self.name} failed ({type(exc).__name__}: {exc})", stacklevel=2)

    def _log(self, step: int, values: Dict[str, float], timestamp: float) -> None:  # pragma: no cover
        raise NotImplementedError

    def _close(self) -> None:  # pragma: no cover
        pass


class WandbSink(Sink):
    """An offline Weights & Biases run in ``run_dir/wandb`` (never contacts a server)."""

    name = "wandb"

    def __init__(self, run_dir, *, project: str, run_name: str, config: Optional[dict] = None):
        super().__init__()
        import wandb

        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode="offline",
                              config=config or {}, reinit="create_new")
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")

    def _log(self, step, values, timestamp):
        self.run.log({**values, "trainer/step": step})

    def _close(self):
        import wandb

        self.run.finish()
        if wandb.run is None:
            # finish() returns before the service has written the offline file; shutting the
            # (now idle) service down waits for it, so the run is on disk when close() returns
            wandb.teardown()


def mlflow_client(run_dir):
    """An ``MlflowClient`` on the local file store ``run_dir/mlruns`` (for writing or reading a run).

    MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE=true``; this sets that opt-in
    (unless the environment already sets it) before the client is made."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(Path(run_dir).resolve() / "mlruns").as_uri())


class MLflowSink(Sink):
    """An MLflow run in the local file store ``run_dir/mlruns``."""

    name = "mlflow"

    def __init__(self, run_dir, *, project: str, run_name: str, config: Optional[dict] = None):
        super().__init__()
        self.client = mlflow_client(run_dir)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        if config:
            from mlflow.entities import Param

            flat = _flatten_config(config)
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in flat.items()])

    def _log(self, step, values, timestamp):
        from mlflow.entities import Metric

        ms = int(timestamp * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def _close(self):
        self.client.set_terminated(self.run_id)


class TrackioSink(Sink):
    """A trackio run stored locally under ``run_dir/trackio``."""

    name = "trackio"

    def __init__(self, run_dir, *, project: str, run_name: str, config: Optional[dict] = None):
        super().__init__()
        os.environ.setdefault("TRACKIO_DIR", str(Path(run_dir).resolve() / "trackio"))
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=run_name, config=config or {}, embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)

    def _log(self, step, values, timestamp):
        self.run.log(values, step=step)

    def _close(self):
        self.run.finish()


SINKS = {"wandb": WandbSink, "mlflow": MLflowSink, "trackio": TrackioSink}


def _flatten_config(cfg: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def build_sinks(backends: Sequence[str], run_dir, *, project: str = "trajgrad", run_name: str = "run",
                config: Optional[dict] = None) -> List[Sink]:
    """The sinks of ``backends`` other than jsonl/tensorboard (which MetricsLogger writes).

    Raises:
      ValueError: an unknown backend, or one whose package is missing (names ``log.backends``).
    """
    unknown = [b for b in backends if b not in SINKS and b not in ("jsonl", "tensorboard")]
    if unknown:
        raise ValueError(f"log.backends: unknown backend {unknown[0]!r}; known: jsonl, tensorboard, "
                         f"{', '.join(SINKS)}")
    missing = missing_backends(backends)
    if missing:
        b, pkg = missing[0]
        raise ValueError(f"log.backends: {b!r} needs the {pkg!r} package, which is not installed")
    return [SINKS[b](run_dir, project=project, run_name=run_name, config=config) for b in backends if b in SINKS]
