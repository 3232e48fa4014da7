"""``trajgrad view --serve``: the page on a loopback-only HTTP server.

The server binds ``127.0.0.1`` only (never another interface) and answers three things:
``GET /`` (the page), ``GET /episode/<row>.json`` (the token detail of a row that the page
could not embed, built on demand) and nothing else (404). It handles one request at a time
(no thread per connection), refuses requests whose ``Host`` header is not the loopback
address it serves (a page on another site cannot reach it through DNS rebinding), and stops
on Ctrl-C (or after ``max_requests`` requests, for tests).
"""
from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable, Dict, Optional

__all__ = ["make_server", "serve"]

HOST = "127.0.0.1"
_EPISODE = re.compile(r"^/episode/(\d{1,9})\.json$")


def make_server(page: str, lookup: Callable[[int], Dict], *, port: int = 8765) -> HTTPServer:
    """A server for ``page`` on ``127.0.0.1:port`` (``port=0``: any free port; see ``server_port``)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected an integer in [0, 65535], got {port!r}")
    body = page.encode("utf-8")

    class Handler(BaseHTTPRequestHandler):
        server_version = "trajgrad-view"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, data: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
            if host not in (HOST, "localhost"):
                self._send(403, b"loopback only\n", "text/plain")
                return
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, body, "text/html; charset=utf-8")
                return
            m = _EPISODE.match(path)
            if m:
                try:
                    data = json.dumps(lookup(int(m.group(1))), allow_nan=False).encode()
                except KeyError:
                    self._send(404, b"no such row\n", "text/plain")
                    return
                self._send(200, data, "application/json")
                return
            self._send(404, b"not found\n", "text/plain")

    return HTTPServer((HOST, port), Handler)


def serve(page: str, lookup: Callable[[int], Dict], *, port: int = 8765, max_requests: Optional[int] = None,
          console=print) -> None:
    """Serve until Ctrl-C (or ``max_requests`` requests)."""
    httpd = make_server(page, lookup, port=port)
    console(f"serving on http://{HOST}:{httpd.server_port}/  (loopback only; Ctrl-C stops)")
    try:
        if max_requests is None:
            httpd.serve_forever()
        else:
            for _ in range(max_requests):
                httpd.handle_request()
    except KeyboardInterrupt:
        console("stopped")
    finally:
        httpd.server_close()
