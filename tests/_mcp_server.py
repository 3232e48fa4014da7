"""A small MCP server for the tests, written with the ``mcp`` SDK's MCPServer (formerly FastMCP).

``python _mcp_server.py`` serves over stdio; ``python _mcp_server.py --http PORT`` over
streamable HTTP on 127.0.0.1:PORT (path ``/mcp``). With ``MCP_PID_DIR`` set, the process
writes an empty file named after its pid there at start (the tests check that every server
they started is stopped); ``MCP_TOOLS=add,counter`` keeps only those tools; with
``MCP_START_ONCE=PATH`` it exits at once when PATH exists, else creates it (it starts once).
"""
import os
import sys
import time

if __name__ == "__main__" and os.environ.get("MCP_PID_DIR"):  # first, before the SDK's imports
    open(os.path.join(os.environ["MCP_PID_DIR"], str(os.getpid())), "w").close()
if __name__ == "__main__" and os.environ.get("MCP_START_ONCE"):  # a server that starts only the first time
    if os.path.exists(os.environ["MCP_START_ONCE"]):
        sys.exit("refusing to start twice")
    open(os.environ["MCP_START_ONCE"], "w").close()

from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import ImageContent, TextContent, ToolAnnotations

server = MCPServer("trajgrad-test")
_count = 0


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def counter() -> str:
    """Count the calls this server process has answered (its state)."""
    global _count
    _count += 1
    return str(_count)


@server.tool()
def fail(reason: str) -> str:
    """Raise an error (the result carries isError)."""
    raise ValueError(reason)


@server.tool()
def rpc_error() -> str:
    """Answer with a JSON-RPC error."""
    raise MCPError(-32602, "rpc_error refuses every request")


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """End the server process."""
    os._exit(3)


@server.tool()
def picture() -> list:
    """A caption and an image."""
    return [TextContent(type="text", text="a red dot:"), ImageContent(type="image", data="aGVsbG8=", mime_type="image/png")]


@server.tool()
def getenv(var: str) -> str:
    """The server's environment variable ``var`` ("" when unset)."""
    return os.environ.get(var, "")


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def wipe(target: str) -> str:
    """Delete a target (annotated destructive)."""
    return f"wiped {target}"


if __name__ == "__main__":
    if os.environ.get("MCP_TOOLS"):
        keep = set(os.environ["MCP_TOOLS"].split(","))
        for name in ("add", "counter", "fail", "rpc_error", "sleep", "crash", "picture", "getenv", "wipe"):
            if name not in keep:
                server.remove_tool(name)
    if os.environ.get("MCP_PID_DIR"):
        open(os.path.join(os.environ["MCP_PID_DIR"], str(os.getpid())), "w").close()
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
