"""``python -m llamacrab.server._child``: the process of one isolated registry entry
(server/_isolation.py). It reads the entry and the settings from the first line of stdin,
serves that entry on loopback with the parent's key, and ends when its parent is gone (the
rest of stdin ends, see llamacrab._parent_watch)."""

from __future__ import annotations

import json
import os

import uvicorn

from llamacrab import ModelEntry
from llamacrab._parent_watch import read_first_line, watch_parent
from llamacrab.server._app import create_app
from llamacrab.server._isolation import PARENT_ENV, settings_from_json
from llamacrab.server._models import entry_registry


def _end() -> None:
    os._exit(1)  # a model may be inside a native call: nothing is torn down under it


def main() -> None:
    spec = json.loads(read_first_line())
    settings = settings_from_json(spec["settings"])
    # isolate=False: this process is the isolation; it runs the model itself.
    entry = ModelEntry(**{**spec["entry"], "isolate": False})
    watched = os.environ.pop(PARENT_ENV, "")
    if watched.isdigit():
        watch_parent(int(watched), _end)
    app = create_app(settings, registry=entry_registry(entry, settings))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
