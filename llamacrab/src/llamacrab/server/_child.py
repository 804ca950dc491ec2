"""``python -m llamacrab.server._child``: the process of one isolated registry entry
(server/_isolation.py). It reads the entry and the settings from stdin, serves that entry on
loopback with the parent's key, and ends when its parent is gone."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import uvicorn

from llamacrab import ModelEntry
from llamacrab.server._app import create_app
from llamacrab.server._isolation import PARENT_ENV, settings_from_json
from llamacrab.server._models import entry_registry


def _end_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # a model may be inside a native call: nothing is torn down under it


def main() -> None:
    spec = json.loads(sys.stdin.read())
    settings = settings_from_json(spec["settings"])
    # isolate=False: this process is the isolation; it runs the model itself.
    entry = ModelEntry(**{**spec["entry"], "isolate": False})
    watched = os.environ.pop(PARENT_ENV, "")
    if watched.isdigit():
        threading.Thread(target=_end_with_parent, args=(int(watched),), daemon=True).start()
    app = create_app(settings, registry=entry_registry(entry, settings))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
