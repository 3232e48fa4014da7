"""Optional packages: a feature whose package is missing says so in one line.

The main job needs only the core and the ``train`` extra. Everything else (the OpenAI-compatible
server and client, Ray, environments from other libraries, datasets, experiment trackers) comes
with an extra of its own and is imported where the feature is used, through :func:`require`::

    httpx = require("httpx", "rollout.backend: openai")

A missing package raises :class:`MissingPackage` (an ``ImportError``) whose message names the
feature, the package and the command that installs it; ``trajgrad`` prints it as one line.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# top-level module -> the extra of pyproject.toml that installs it
EXTRAS = {
    "transformers": "train", "peft": "train", "accelerate": "train", "safetensors": "train",
    "gguf": "train", "matplotlib": "train", "tensorboard": "train",
    "ray": "dist", "fastapi": "dist", "uvicorn": "dist", "httpx": "dist",
    "gymnasium": "byo", "verifiers": "byo", "openenv": "byo", "datasets": "byo", "mcp": "byo",
    "wandb": "tracking", "mlflow": "tracking", "trackio": "tracking",
    "openai": "test", "anthropic": "test",
}


class MissingPackage(ImportError):
    """An optional package a feature needs is not installed (the message says how to install it)."""


def install_hint(package: str) -> str:
    """The command that installs ``package`` with the trajgrad extra that carries it."""
    extra = EXTRAS.get(package.split(".")[0])
    if extra is None:
        return f"pip install {package.split('.')[0]}"
    return f'pip install "trajgrad[{extra}]" (from a checkout: pip install -e ".[{extra}]")'


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise :class:`MissingPackage` naming both and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        name = getattr(exc, "name", None)
        if name and name != top and not name.startswith(top + "."):
            raise  # the package is there but one of its own imports failed: show that error
        raise MissingPackage(f"{feature} needs the package {top!r}, which is not installed: "
                             f"{install_hint(top)}") from exc
