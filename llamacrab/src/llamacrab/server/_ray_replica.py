"""One Ray Serve replica: the whole server (its model, routes, API keys and slots, or a model
registry) as the replica's ASGI app. Imports ray: only ``_ray`` imports it, when asked for a
deployment, so the server runs without the ``ray`` extra."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from ray import serve
from starlette.types import ASGIApp, Receive, Scope, Send

from llamacrab._llama import Llama
from llamacrab.server._app import create_app
from llamacrab.server._request_id import with_headers
from llamacrab.server._settings import ServerSettings
from llamacrab.server._state import open_llama

REPLICA_HEADER = "x-llamacrab-replica"


class ReplicaHeaderMiddleware:
    """Names the replica that answered in every response (Serve's proxy hides which did)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        await self.app(scope, receive, with_headers(send, [self.header]))


class Replica:
    """What Serve constructs on each replica; it then asks for the ASGI app (and runs its
    lifespan)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.llama: Llama | None = None

    async def __serve_build_asgi_app__(self) -> FastAPI:
        # Loaded before the replica counts as ready, so Serve routes nothing to it meanwhile
        # (the plain server loads in the background and answers 503 until then). A registry
        # loads its models on demand, as it does without Ray.
        if not self.settings.multi_model:
            self.llama = await asyncio.to_thread(open_llama, self.settings)
        app = create_app(self.settings, self.llama)
        replica = serve.get_replica_context().replica_id.unique_id
        app.add_middleware(ReplicaHeaderMiddleware, replica=replica)
        return app

    def __del__(self) -> None:
        # Serve calls this at a graceful shutdown, after the replica's requests finished.
        if self.llama is not None:
            self.llama.close()


ReplicaIngress = serve.ingress()(Replica)
