"""A starjar cluster on a Ray cluster of someone else's (`ray up`): detached actors created there, and
stopped there, by name. Nothing runs on this machine in between."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from controller.cluster.spec import CONTROLLER, NAMESPACE, READY_TIMEOUT_S, ClusterSpec, reload_ray_auth


def _ray_auth_if_token() -> None:
    """Ray's token auth when a Ray token is at hand and RAY_AUTH_MODE says nothing: Ray itself turns it on
    only for address "auto", and a cluster started with RAY_AUTH_MODE=token refuses a driver without it."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file()):
        os.environ["RAY_AUTH_MODE"] = "token"
        reload_ray_auth()


def start_remote(spec: ClusterSpec, address: str) -> dict:
    """Create the controller on the Ray cluster at `address`; its addresses once everything serves."""
    import ray

    from controller.cluster.controller_actor import HEAD, Controller, actor_options

    _ray_auth_if_token()
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    ctl = ray.remote(Controller).options(**actor_options(CONTROLLER, HEAD)).remote(spec.to_dict())
    return ray.get(ctl.wait_ready.remote(READY_TIMEOUT_S))


def stop_remote(address: str, on_drain: Callable[[float], None]) -> bool:
    """Drain and stop the cluster's actors (False: there are none); on_drain(seconds) is told the drain's
    limit before it starts."""
    import ray

    _ray_auth_if_token()
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        ctl = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        return False
    drain_s = ray.get(ctl.describe.remote(), timeout=60).get("drain_timeout_s", 30.0)
    on_drain(drain_s)
    ray.get(ctl.shutdown.remote(), timeout=drain_s + 60)
    ray.kill(ctl, no_restart=True)
    return True
