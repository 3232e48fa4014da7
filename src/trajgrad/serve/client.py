"""Client side of the proxy: report an episode's reward (standard library only).

An agent run by ``rollout.backend: proxy`` finds its endpoint in ``OPENAI_BASE_URL``
(``http://127.0.0.1:PORT/s/<session>/v1``: the session is part of the URL, so an unchanged
``openai.OpenAI()`` client is recorded under it) and its session id in
``TRAJGRAD_SESSION``. When the episode is over it reports the reward::

    from trajgrad.serve.client import report_reward
    report_reward(1.0, success=True)          # reads OPENAI_BASE_URL / TRAJGRAD_SESSION

or, without Python: ``curl -X POST $TRAJGRAD_REWARD_URL -d '{"reward": 1.0}'``.
"""
from __future__ import annotations

import json
import math
import os
import re
import urllib.error
import urllib.request
from typing import Any, Dict, Optional

__all__ = ["report_reward", "server_root", "session_base_url"]

_SUFFIX = re.compile(r"(/s/[^/]+)?/v1$")


def server_root(base_url: str) -> str:
    """``http://host:port`` from a base URL ending in ``/v1`` or ``/s/<session>/v1`` (or the root)."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url: expected an http(s) URL, got {base_url!r}")
    return _SUFFIX.sub("", base_url.rstrip("/"))


def session_base_url(root: str, session: str) -> str:
    """The OpenAI base URL that records every call under ``session``."""
    return f"{server_root(root)}/s/{session}/v1"


def report_reward(reward: float, *, session: Optional[str] = None, base_url: Optional[str] = None,
                  success: Optional[bool] = None, info: Optional[Dict[str, Any]] = None,
                  timeout_s: float = 30.0) -> Dict[str, Any]:
    """End episode ``session`` with ``reward`` (``POST /v1/trajgrad/episodes/{session}/reward``).

    Args:
      reward: a finite number.
      session: the episode's session id (default: ``$TRAJGRAD_SESSION``).
      base_url: the server (default: ``$OPENAI_BASE_URL``); ``/v1`` and ``/s/<id>/v1`` suffixes are fine.
      success: whether the episode succeeded (held-out success counts it).
      info: anything JSON-serializable, kept in the trajectory's metadata.

    Returns the server's answer; raises ``ValueError`` for a bad argument or a refused report.
    """
    session = session or os.environ.get("TRAJGRAD_SESSION")
    base_url = base_url or os.environ.get("OPENAI_BASE_URL")
    if not session:
        raise ValueError("session: not given and TRAJGRAD_SESSION is not set")
    if not base_url:
        raise ValueError("base_url: not given and OPENAI_BASE_URL is not set")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise ValueError(f"reward: expected a finite number, got {reward!r}")
    body: Dict[str, Any] = {"reward": float(reward)}
    if success is not None:
        body["success"] = bool(success)
    if info is not None:
        body["info"] = info
    url = f"{server_root(base_url)}/v1/trajgrad/episodes/{session}/reward"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read().decode())["error"]["message"]
        except Exception:
            message = str(exc)
        raise ValueError(f"session: the server refused the reward ({exc.code}: {message})") from None
