"""Tools of MCP servers (Model Context Protocol), called with the official ``mcp`` SDK (§22).

A server is named by a config, the ``mcp`` entry of a task's ``tools`` list or an item of
``ToolEnv(mcp=[...])``::

    {"command": "python", "args": ["server.py"], "env": {"KEY": "value"}}   # stdio: trajgrad starts it
    {"url": "http://127.0.0.1:8000/mcp"}                                    # streamable HTTP: trajgrad connects

Options: ``shared`` (default false), ``timeout_s`` (per call, default 30),
``startup_timeout_s`` (default 30), ``irreversible`` (tool names that need the
confirmation hook, like an irreversible Python tool; a tool the server annotates
``destructiveHint: true`` needs it too).

* **Listing.** The server's tools are listed once per process and config (a server that
  cannot start or answer is a ``ValueError`` naming the config key, at load time). Each
  becomes a :class:`~trajgrad.envs.tools.Tool` whose schema is the OpenAI function
  schema ``{"type": "function", "function": {"name", "description", "parameters":
  inputSchema}}`` that the chat template renders; the registry's allowlist and
  confirmation apply to it like to every tool.
* **Calls.** A call sends the parsed arguments to the server; the result's content becomes
  the tool message (text as is; an image, audio or binary resource as one bracketed line
  naming its type and size). A failure is a tool error the agent sees, never an
  exception of the run, counted by reason (:data:`ERROR_REASONS`): ``start`` (the server
  did not start for this episode), ``timeout`` (no answer within ``timeout_s``),
  ``crash`` (the server exited or the connection broke), ``rpc`` (a JSON-RPC error),
  ``tool`` (a result with ``isError``). :func:`mcp_metrics` turns the counts into the
  step's ``tools/mcp_error_frac/<reason>``.
* **Lifecycle.** By default each episode has its own connection, i.e. its own stdio
  server process, started in the background at ``reset`` and stopped in the background at
  the episode's end (:meth:`MCPSession.end`): no state passes between episodes or between
  the rollouts of a group. The episodes of a rollout batch run at once, so up to
  ``prompts_per_step x group_size`` servers do too. ``shared: true`` keeps one connection
  per config and worker process for every episode (state may leak between episodes; a
  warning says so). :func:`close_mcp_servers` stops every server of the process and waits
  for them; it also runs at interpreter exit.

The SDK is asynchronous (anyio): every connection is one task on a single event loop
thread per process, which owns the client's context from connect to close; the
synchronous environment waits on futures. A stdio server is the user's own program and
runs with the user's privileges, outside the Python-tool sandbox.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import math
import os
import threading
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from .tool_result import ToolResult
from .tools import Tool

__all__ = ["ERROR_REASONS", "MCPServerConfig", "MCPTools", "MCPSession", "mcp_server_config", "mcp_metrics",
           "close_mcp_servers"]

ERROR_REASONS = ("start", "timeout", "crash", "rpc", "tool")
_OPTIONS = ("command", "args", "env", "url", "shared", "timeout_s", "startup_timeout_s", "irreversible")
_GRACE_S = 10.0  # the waiting thread's margin over the loop's own deadlines


@dataclass(frozen=True)
class MCPServerConfig:
    """One MCP server: ``command`` (+ ``args``, ``env``) for stdio, or ``url`` for streamable HTTP."""

    command: Optional[str] = None
    args: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    url: Optional[str] = None
    shared: bool = False
    timeout_s: float = 30.0
    startup_timeout_s: float = 30.0
    irreversible: Tuple[str, ...] = ()
    where: str = field(default="mcp", compare=False)

    @property
    def identity(self) -> str:
        """The server's identity (what is started or connected to)."""
        return json.dumps([self.command, list(self.args), dict(self.env), self.url])

    def describe(self) -> str:
        return self.url if self.url else " ".join([self.command or "", *self.args])


def _check_number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _check_strings(value: Any, key: str) -> Tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}: expected a list of strings, got {value!r}")
    return tuple(value)


def mcp_server_config(spec: Any, key: str = "mcp") -> MCPServerConfig:
    """The :class:`MCPServerConfig` of ``spec``: a config, ``{"mcp": {...}}`` or the inner
    dict. ``ValueError`` naming ``key`` (e.g. ``tools.1.mcp.url``) for a bad entry."""
    if isinstance(spec, MCPServerConfig):
        return spec
    if isinstance(spec, Mapping) and set(spec) == {"mcp"}:
        spec, key = spec["mcp"], f"{key}.mcp"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{key}: expected {{command: ..., args: [...]}} or {{url: ...}}, got {spec!r}")
    unknown = sorted(set(spec) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown option (options: {', '.join(_OPTIONS)})")
    command, url = spec.get("command"), spec.get("url")
    if (command is None) == (url is None):
        raise ValueError(f"{key}: give exactly one of command (a stdio server) or url (a streamable HTTP server)")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise ValueError(f"{key}.command: expected a non-empty string, got {command!r}")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise ValueError(f"{key}.url: expected an http:// or https:// URL, got {url!r}")
    if url is not None and ("args" in spec or "env" in spec):
        raise ValueError(f"{key}: args and env belong to a stdio server (command), not to url")
    env = spec.get("env") or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{key}.env: expected a mapping of strings to strings, got {env!r}")
    shared = spec.get("shared", False)
    if not isinstance(shared, bool):
        raise ValueError(f"{key}.shared: expected true or false, got {shared!r}")
    return MCPServerConfig(
        command=command, args=_check_strings(spec.get("args", []), f"{key}.args"), env=tuple(sorted(env.items())),
        url=url, shared=shared, timeout_s=_check_number(spec.get("timeout_s", 30.0), f"{key}.timeout_s"),
        startup_timeout_s=_check_number(spec.get("startup_timeout_s", 30.0), f"{key}.startup_timeout_s"),
        irreversible=_check_strings(spec.get("irreversible", []), f"{key}.irreversible"), where=key)


# ----------------------------------------------------------------------------- the event loop thread

_LOCK = threading.Lock()
_STATE: Dict[str, Any] = {"loop": None, "pid": None}
_LIVE: "set[_Connection]" = set()
_SHARED: Dict[str, "_Connection"] = {}
_CATALOG: Dict[str, List[dict]] = {}


def _loop() -> asyncio.AbstractEventLoop:
    """This process's MCP event loop (a daemon thread; a forked child starts its own)."""
    with _LOCK:
        if _STATE["loop"] is None or _STATE["pid"] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="trajgrad-mcp", daemon=True).start()
            _STATE.update(loop=loop, pid=os.getpid())
            _LIVE.clear()
            _SHARED.clear()
            atexit.register(close_mcp_servers)
        return _STATE["loop"]


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    exc = _leaf(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _b64_size(data: str) -> int:
    """Bytes encoded by the base64 text ``data``."""
    return len(data) * 3 // 4 - data[-2:].count("=")


def _content_text(result: Any) -> str:
    """The text of a ``CallToolResult``: text blocks as is, other blocks described."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} content: {block.mime_type}, {_b64_size(block.data)} bytes, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri} ({block.name})]")
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(text if text is not None else
                         f"[resource {res.uri}: {res.mime_type or 'binary'}, {_b64_size(res.blob)} bytes, not shown]")
        else:
            parts.append(f"[{kind or type(block).__name__} content, not shown]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


class _Connection:
    """One client connection (for stdio: one server process), owned by one task on the loop."""

    def __init__(self, config: MCPServerConfig) -> None:
        self.config = config
        self.ready: Future = Future()  # the tool listing, or the reason the connection failed
        self.dead: Optional[str] = None
        self._loop = _loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._scope = None
        self._finished = False
        with _LOCK:
            _LIVE.add(self)
        self.done = asyncio.run_coroutine_threadsafe(self._main(), self._loop)

    def _transport(self):
        if self.config.url is not None:
            return self.config.url
        from mcp.client.stdio import StdioServerParameters, stdio_client

        return stdio_client(StdioServerParameters(command=self.config.command, args=list(self.config.args),
                                                  env=dict(self.config.env) or None))

    async def _main(self) -> None:
        import anyio
        from mcp.client import Client

        current = None
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                scope.deadline = anyio.current_time() + self.config.startup_timeout_s
                async with Client(self._transport()) as client:
                    listing, cursor = [], None
                    while True:
                        page = await client.list_tools(cursor=cursor)
                        listing.extend(t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in page.tools)
                        cursor = page.next_cursor
                        if not cursor:
                            break
                    scope.deadline = math.inf
                    self.ready.set_result(listing)
                    while True:
                        current = await self._queue.get()
                        if current is None:
                            break
                        if not await self._call(client, *current):
                            break  # the connection is gone
                        current = None
            if not self.ready.done():
                raise TimeoutError(f"no answer within startup_timeout_s={self.config.startup_timeout_s:g}")
        except BaseException as exc:  # the transport failed: every waiter learns why, the run goes on
            self.dead = self.dead or _describe(exc)
            if not self.ready.done():
                self.ready.set_exception(_leaf(exc) if isinstance(_leaf(exc), Exception) else RuntimeError(self.dead))
            if current is not None and not current[2].done():
                current[2].set_result((ToolResult("", f"the MCP server connection broke ({self.dead})"), "crash"))
        finally:
            self._finished = True
            while not self._queue.empty():
                req = self._queue.get_nowait()
                if req is not None:
                    req[2].set_result(self._dead_result())
            with _LOCK:
                _LIVE.discard(self)

    def _dead_result(self) -> Tuple[ToolResult, str]:
        return ToolResult("", f"the MCP server is not running ({self.dead or 'stopped'})"), "crash"

    async def _call(self, client, name: str, arguments: dict, fut: Future) -> bool:
        import anyio
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            with anyio.fail_after(self.config.timeout_s):
                result = await client.call_tool(name, arguments)
        except TimeoutError:
            fut.set_result((ToolResult("", f"{name} did not answer within timeout_s={self.config.timeout_s:g} s"),
                            "timeout"))
            return True
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                self.dead = f"the server closed the connection ({exc})"
                fut.set_result((ToolResult("", f"the MCP server exited during {name} ({exc})"), "crash"))
                return False
            fut.set_result((ToolResult("", f"{name}: JSON-RPC error {exc.code}: {exc}"), "rpc"))
            return True
        except Exception as exc:  # a result the SDK could not read, a broken pipe, ...
            fut.set_result((ToolResult("", f"{name}: {_describe(exc)}"), "rpc"))
            return True
        text = _content_text(result)
        if result.is_error:
            fut.set_result((ToolResult("", text or f"{name} failed"), "tool"))
        else:
            fut.set_result((ToolResult(text, None), None))
        return True

    def _submit(self, request) -> None:  # on the loop thread
        if self._finished:
            request[2].set_result(self._dead_result())
        else:
            self._queue.put_nowait(request)

    def call(self, name: str, arguments: dict) -> Tuple[ToolResult, Optional[str]]:
        """(result, error reason or None) of one call; never raises."""
        try:
            self.ready.result(timeout=self.config.startup_timeout_s + _GRACE_S)
        except FutureTimeout:
            return ToolResult("", f"the MCP server did not start within {self.config.startup_timeout_s:g} s"), "start"
        except Exception as exc:
            return ToolResult("", f"the MCP server did not start ({_describe(exc)})"), "start"
        fut: Future = Future()
        self._loop.call_soon_threadsafe(self._submit, (name, arguments, fut))
        try:
            return fut.result(timeout=self.config.timeout_s + _GRACE_S)
        except FutureTimeout:
            return ToolResult("", f"{name} did not answer within timeout_s={self.config.timeout_s:g} s"), "timeout"

    def _stop(self) -> None:  # on the loop thread
        if not self.ready.done() and self._scope is not None:
            self._scope.cancel()
        self._queue.put_nowait(None)

    def close(self, wait: bool = True) -> None:
        """Stop the connection (for stdio the SDK closes stdin, then terminates and kills the
        process tree); ``wait`` blocks until it is stopped (bounded)."""
        if not self.done.done():
            self._loop.call_soon_threadsafe(self._stop)
        if wait:
            try:
                self.done.result(timeout=self.config.startup_timeout_s + _GRACE_S)
            except Exception:
                pass


def close_mcp_servers() -> None:
    """Stop every MCP connection of this process (shared ones included) and wait for them."""
    with _LOCK:
        live = list(_LIVE) + list(_SHARED.values())
        _SHARED.clear()
    for conn in live:
        conn.close(wait=False)
    for conn in live:
        conn.close(wait=True)


def _listing(config: MCPServerConfig) -> List[dict]:
    """The server's tools, listed once per process and server (a short-lived connection)."""
    if config.identity in _CATALOG:
        return _CATALOG[config.identity]
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ValueError(f"{config.where}: MCP tools need the mcp package (pip install 'trajgrad[byo]')") from None
    conn = _Connection(config)
    try:
        listing = conn.ready.result(timeout=config.startup_timeout_s + _GRACE_S)
    except FutureTimeout:
        raise ValueError(f"{config.where}: the MCP server {config.describe()!r} did not answer within "
                         f"startup_timeout_s={config.startup_timeout_s:g}") from None
    except Exception as exc:
        raise ValueError(f"{config.where}: the MCP server {config.describe()!r} did not start "
                         f"({_describe(exc)})") from None
    finally:
        conn.close(wait=False)
    _CATALOG[config.identity] = listing
    return listing


class MCPTools:
    """The tools one MCP server offers (listed at construction: a ``ValueError`` naming
    ``key`` when the server cannot start)."""

    def __init__(self, spec: Any, *, key: str = "mcp") -> None:
        self.config = mcp_server_config(spec, key)
        self.listing = _listing(self.config)
        names = [t["name"] for t in self.listing]
        missing = [n for n in self.config.irreversible if n not in names]
        if missing:
            raise ValueError(f"{self.config.where}.irreversible: the server has no tool {missing[0]!r} "
                             f"(its tools: {', '.join(names) or 'none'})")
        if self.config.shared:
            warnings.warn(f"{self.config.where}.shared: one MCP server per worker process serves every episode; "
                          "its state may leak between episodes and between the rollouts of a group", stacklevel=2)

    @property
    def schemas(self) -> List[dict]:
        """The OpenAI function-tool schemas of the server's tools."""
        return [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or t.get("title") or t["name"],
            "parameters": t.get("inputSchema") or {"type": "object", "properties": {}}}} for t in self.listing]

    def irreversible(self, name: str) -> bool:
        spec = next(t for t in self.listing if t["name"] == name)
        hints = spec.get("annotations") or {}
        return name in self.config.irreversible or hints.get("destructiveHint") is True


class MCPSession:
    """An environment's use of one server: its tools, the current episode's connection and
    the call counts by reason."""

    def __init__(self, server: MCPTools) -> None:
        if not isinstance(server, MCPTools):
            raise ValueError(f"server: expected MCPTools, got {type(server).__name__}")
        self.server = server
        self._conn: Optional[_Connection] = None
        self.calls = 0
        self.errors: Dict[str, int] = {}

    def tools(self) -> List[Tool]:
        """One :class:`Tool` per server tool; its argument is the JSON object of the call."""
        out = []
        for schema in self.server.schemas:
            fn = schema["function"]

            def call(argument: str, _name=fn["name"]):
                return self.call(_name, argument)

            out.append(Tool(fn["name"], call, fn["description"], irreversible=self.server.irreversible(fn["name"]),
                            schema=schema))
        return out

    def begin(self) -> None:
        """A new episode: its own server (started in the background), or the shared one."""
        self.end()
        cfg = self.server.config
        if not cfg.shared:
            self._conn = _Connection(cfg)
            return
        _loop()
        with _LOCK:
            conn = _SHARED.get(cfg.identity)
        if conn is None or conn.done.done():
            conn = _Connection(cfg)
            with _LOCK:
                _SHARED[cfg.identity] = conn
        self._conn = conn

    def end(self) -> None:
        """The episode is over: stop its server in the background (a shared one keeps running)."""
        conn, self._conn = self._conn, None
        if conn is not None and not self.server.config.shared:
            conn.close(wait=False)

    def call(self, name: str, argument: str) -> ToolResult:
        try:
            arguments = json.loads(argument) if argument.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolResult("", f"arguments of {name} are not valid JSON ({exc.msg})")
        if not isinstance(arguments, dict):
            return ToolResult("", f"arguments of {name} must be a JSON object")
        if self._conn is None:
            self.begin()
        result, reason = self._conn.call(name, arguments)
        self.calls += 1
        if reason is not None:
            self.errors[reason] = self.errors.get(reason, 0) + 1
        return result

    def take_counts(self) -> Tuple[int, Dict[str, int]]:
        """(calls, {reason: errors}) since the last call of this method."""
        out = (self.calls, dict(self.errors))
        self.calls, self.errors = 0, {}
        return out


def mcp_metrics(trajectories: Iterable[Any]) -> Dict[str, float]:
    """``tools/mcp_calls`` (the MCP calls of the trajectories' turns) and, when there were
    calls, ``tools/mcp_error_frac/<reason>`` = errors of that reason / calls, for every
    reason of :data:`ERROR_REASONS`; ``{}`` when no turn used an MCP server."""
    calls, errors, seen = 0, dict.fromkeys(ERROR_REASONS, 0), False
    for traj in trajectories:
        for turn in traj.turns:
            if "mcp_calls" not in turn.info:
                continue
            seen = True
            calls += int(turn.info["mcp_calls"])
            for reason, n in (turn.info.get("mcp_errors") or {}).items():
                errors[reason] = errors.get(reason, 0) + int(n)
    if not seen:
        return {}
    out = {"tools/mcp_calls": float(calls)}
    if calls:
        out.update({f"tools/mcp_error_frac/{r}": n / calls for r, n in errors.items()})
    return out
