"""The HTTP server's mechanism: a listening socket made before any URL is printed, and uvicorn
on a background thread (`ApiServer`, for tests and embedding)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: the OS picks), ready before any URL is printed.

    Raises ValueError naming --port when the address cannot be bound.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--port: cannot listen on {host}:{port} ({exc})") from None
    sock.listen(2048)
    return sock


class ApiServer:
    """Runs an app with uvicorn on a background thread: for tests and embedding.

    `start()` returns once the socket listens; `port` is the bound port (pass port=0 to let the
    OS choose). `close()` stops accepting, finishes in-flight responses and joins the thread.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                      lifespan="off")
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread = threading.Thread(target=self._server.run, name="kvcake-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self._config.host}:"
                                   f"{self._config.port}")
            time.sleep(0.01)  # uvicorn offers no start event to wait on

    @property
    def port(self) -> int:
        sockets = self._server.servers[0].sockets
        return int(sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self._config.host}:{self.port}"

    def close(self) -> None:
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
