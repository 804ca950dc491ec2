"""Our server, running for real on a loopback port in a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from llamacrab import Llama, ModelRegistry
from llamacrab.server import ServerSettings
from llamacrab.server._app import create_app  # the public one takes no registry


class LiveServer:
    """``create_app(settings, llama, registry)`` served by uvicorn on 127.0.0.1 (a free port)."""

    def __init__(self, settings: ServerSettings, llama: Llama | None = None,
                 registry: ModelRegistry | None = None) -> None:  # fmt: skip
        app = create_app(settings, llama, registry)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def wait_until_loaded(self, timeout: float = 60) -> int:
        """Poll /health until it stops answering "loading"; its final status."""
        deadline = time.monotonic() + timeout
        while True:
            response = httpx.get(self.url + "/health")
            if response.json().get("status") != "loading" or time.monotonic() > deadline:
                return response.status_code
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def running(settings: ServerSettings) -> Iterator[LiveServer]:
    """A LiveServer of ``settings`` whose model has loaded, closed when the generator is (a
    fixture's body: ``yield from running(settings)``)."""
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200, httpx.get(server.url + "/health").text
        yield server
    finally:
        server.close()
