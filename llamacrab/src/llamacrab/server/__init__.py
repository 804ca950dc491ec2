"""An OpenAI-compatible HTTP server (``pip install 'llamacrab[server]'``).

Start it with ``llamacrab serve MODEL`` or ``python -m llamacrab.server MODEL``; embed or test
the ASGI application that ``create_app(settings)`` returns; ``ray_deployment(settings, ...)``
runs replicas of it on Ray Serve (``pip install 'llamacrab[ray]'``). The web stack and Ray are
imported only here, when used, so the rest of llamacrab works without the extras.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llamacrab import init_numa
from llamacrab.server._extra import MissingExtraError
from llamacrab.server._ray import ray_deployment, serve_ray
from llamacrab.server._settings import (
    ServerSettings,
    add_arguments,
    parse_settings,
    settings_from_args,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llamacrab._llama import Llama

__all__ = [
    "MissingExtraError",
    "ServerSettings",
    "add_arguments",
    "create_app",
    "parse_settings",
    "ray_deployment",
    "serve",
    "serve_ray",
    "settings_from_args",
]


def create_app(settings: ServerSettings, llama: Llama | None = None) -> FastAPI:
    """The FastAPI application. Without ``llama`` it loads ``settings.model`` in the
    background; ``/health`` answers 503 until the model is ready."""
    try:
        from llamacrab.server._app import create_app as build
    except ImportError as error:
        raise MissingExtraError(
            f"the server needs its extra: pip install 'llamacrab[server]' ({error})"
        ) from error
    return build(settings, llama)


def serve(settings: ServerSettings) -> None:
    """Run the server until interrupted (refuses an exposed address without an API key)."""
    settings.check_exposure()
    if settings.numa is not None:  # before any model loads, as llama-server does
        init_numa(settings.numa)
    app = create_app(settings)
    from llamacrab.server._shutdown import run

    run(app, settings.host, settings.port, settings.shutdown_timeout)
