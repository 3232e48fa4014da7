"""Run a served app in this process: uvicorn in a thread on a free loopback port."""
from __future__ import annotations

import socket
import threading
import time

from .._optional import require

__all__ = ["LoopbackServer"]


class LoopbackServer:
    """``with LoopbackServer(app) as srv:`` serves ``app`` on ``127.0.0.1:<free port>`` (``srv.url``).

    The socket is bound before the thread starts (port 0: the system picks a free port), so
    the URL is known and never raced for. :meth:`close` (or leaving the block) stops the
    server and joins its thread.
    """

    def __init__(self, app, *, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
        uvicorn = require("uvicorn", "the loopback server")

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.app = app
        self.start_timeout_s = float(start_timeout_s)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="trajgrad-loopback-server")
        self._started = False

    def start(self) -> "LoopbackServer":
        if self._started:
            return self
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the loopback server on port {self.port} did not start")
            time.sleep(0.01)
        self._started = True
        return self

    def close(self) -> None:
        if self._started:
            self.server.should_exit = True
            self.thread.join(timeout=10)
            self._started = False
        self.sock.close()

    def __enter__(self) -> "LoopbackServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
