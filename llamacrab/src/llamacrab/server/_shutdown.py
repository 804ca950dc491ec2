"""Stopping the server on SIGTERM or Ctrl-C while requests run.

Told to exit, uvicorn stops accepting connections and waits for the open ones without end: a
stream of thousands of tokens kept the process up for minutes, until a service manager killed
it. Its force quit (a second Ctrl-C) cancels the requests' tasks mid-answer instead: a
traceback each, 500s, streams cut without their end. Here the first signal gives the requests
in flight ``shutdown_timeout`` seconds, then closes the models: a request still generating ends
as one whose model closed (503 ``shutting_down``, or that error event closing its stream), its
connection closes, and uvicorn exits. A second signal closes the models at once; a third is
uvicorn's force quit.
"""

from __future__ import annotations

import logging
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from llamacrab import ModelLoadError
from llamacrab.server._state import ServerState

log = logging.getLogger("llamacrab.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self._state = state
        self._grace = grace
        self._signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            super().handle_exit(sig, frame)  # stop accepting; wait for the connections
            if self._grace > 0:
                log.info("stopping: requests in flight have %g s to finish (again: at once)",
                         self._grace)  # fmt: skip
            self._close_models_after(self._grace)
        elif self._signals == 2:
            log.warning("stopping now: closing the models")
            self._close_models_after(0)
        else:
            super().handle_exit(sig, frame)  # uvicorn's force quit

    def stop(self) -> None:
        """Leave as the first signal does, the requests in flight being none."""
        self.should_exit = True

    def _close_models_after(self, seconds: float) -> None:
        # Not here: this runs on the event loop, and a close waits for native calls to return.
        timer = threading.Timer(seconds, self._state.close_models)
        timer.daemon = True
        timer.start()


def run(app: FastAPI, host: str, port: int, grace: float) -> None:
    """Serve ``app`` (made by create_app) until SIGTERM or Ctrl-C, stopping as above. A
    model that fails to load stops it too, as llama-server exits: ModelLoadError says why
    (a server answering 503 for ever looked up to a service manager)."""
    state: ServerState = app.state.llamacrab
    config = uvicorn.Config(app, host=host, port=port, log_level="info")
    server = GracefulServer(config, state, grace)
    state.on_load_failure = server.stop  # from the loading thread: uvicorn polls the flag
    server.run()
    if state.error is not None and state.llama is None:
        raise ModelLoadError(f"the model failed to load: {state.error}")
