"""Server replicas on Ray Serve (``pip install 'llamacrab[ray]'``): each replica is the whole
OpenAI-compatible server, on whichever node of the Ray cluster Serve places it, behind Serve's
HTTP proxy. Ray is imported when a deployment is asked for, never at import time."""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from llamacrab._exceptions import InvalidParameterError
from llamacrab.server._extra import MissingExtraError
from llamacrab.server._llama_kwargs import llama_kwargs
from llamacrab.server._settings import ServerSettings

if TYPE_CHECKING:
    from ray.serve import Application

APP_NAME = "llamacrab"


def ray_deployment(
    settings: ServerSettings,
    *,
    num_replicas: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    name: str = APP_NAME,
) -> Application:
    """A Ray Serve application of ``settings``' server: ``num_replicas`` replicas (default 1),
    or as many as ``autoscaling_config`` (Serve's: ``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``, ...) decides. Each replica loads the model itself before it
    takes requests. Run it with ``ray.serve.run(app)``.

    ``ray_actor_options`` reserves each replica's resources (``num_cpus`` defaults to
    ``settings.n_threads`` or 1; ``num_gpus``, ``resources``, ... are Ray's).
    ``max_ongoing_requests`` (default: twice ``settings.parallel``) is what Serve sends one
    replica at once; the rest wait in Serve's queue, where any replica can take them, up to
    ``settings.max_queue`` before Serve answers 503."""
    serve = _import_serve()
    if not settings.multi_model:
        llama_kwargs(settings)  # flags that cannot work together fail here, not on each replica
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_cpus": settings.n_threads or 1, **(ray_actor_options or {})},
        "max_ongoing_requests": max_ongoing_requests or 2 * settings.parallel,
        "max_queued_requests": settings.max_queue,
    }
    options.update(_replica_count(num_replicas, autoscaling_config))
    if options["max_ongoing_requests"] < 1:
        raise InvalidParameterError("max_ongoing_requests must be >= 1")
    from llamacrab.server._ray_replica import ReplicaIngress

    deployment = serve.deployment(ReplicaIngress, **options)
    application: Application = deployment.bind(settings)
    return application


def serve_ray(
    settings: ServerSettings,
    *,
    address: str | None = None,
    num_replicas: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    ray_actor_options: dict[str, Any] | None = None,
) -> None:
    """``llamacrab serve --ray``: join the Ray cluster at ``address`` (default: ``RAY_ADDRESS``,
    else a new one on this machine), start Serve's proxy on ``settings.host:port``, deploy the
    replicas and wait until interrupted, then delete the application."""
    settings.check_exposure()
    app = ray_deployment(settings, num_replicas=num_replicas,
                         autoscaling_config=autoscaling_config,
                         ray_actor_options=ray_actor_options)  # fmt: skip
    import ray
    from ray import serve

    ray.init(address=address)
    # Serve keeps the proxy options of its first start in a cluster; a later start reuses them.
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"llamacrab: serving on http://{settings.host}:{settings.port} through Ray Serve "
          "(Ctrl-C ends)", file=sys.stderr)  # fmt: skip
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop, as Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:  # a cluster this process started ends with it; a joined one keeps running
        serve.delete(APP_NAME)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _replica_count(
    num_replicas: int | None, autoscaling_config: dict[str, Any] | None
) -> dict[str, Any]:
    if autoscaling_config is None:
        replicas = 1 if num_replicas is None else num_replicas
        if replicas < 1:
            raise InvalidParameterError("num_replicas must be >= 1")
        return {"num_replicas": replicas}
    if num_replicas is not None:
        raise InvalidParameterError("pass num_replicas or autoscaling_config, not both")
    low, high = autoscaling_config.get("min_replicas", 1), autoscaling_config.get("max_replicas")
    if high is None or not 0 <= low <= high or high < 1:
        raise InvalidParameterError(
            "autoscaling_config needs max_replicas >= 1 and 0 <= min_replicas <= max_replicas"
        )
    return {"autoscaling_config": autoscaling_config}


def _import_serve() -> Any:
    try:
        from ray import serve
    except ImportError as error:
        raise MissingExtraError(
            f"replicas on Ray Serve need the ray extra: pip install 'llamacrab[ray]' ({error})"
        ) from error
    return serve
