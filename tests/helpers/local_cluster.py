"""A `starjar up` cluster on this machine for the cluster tests: started through the CLI as a user would,
Ray joined from the test, stopped with `starjar down` (also when `up` itself fails)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

from cluster_cli import cli


@contextmanager
def up_cluster(tmp_path_factory, *up_args: str):
    """Yields (addresses, controller actor handle) of a cluster started with `starjar up *up_args`."""
    home = tmp_path_factory.mktemp("starjar_home")
    env = dict(os.environ, STARJAR_HOME=str(home))
    try:
        up = cli("up", *up_args, "--grpc-port", "0", "--http-port", "0", "--json", env=env)
        assert up.returncode == 0, up.stderr[-3000:]
    except BaseException:
        cli("down", env=env, timeout=180)  # a cluster that never got ready is stopped too
        raise
    addrs = json.loads(up.stdout.strip().splitlines()[-1])
    # Its metrics endpoints require the cluster's token, as its gRPC ports do.
    addrs["metrics_token"] = json.loads((home / "run" / "spec.json").read_text())["cluster_token"]
    state = json.loads((home / "run" / "cluster.json").read_text())
    import ray

    from controller.cluster.spec import CONTROLLER, NAMESPACE, local_ray_env

    local_ray_env(home / "run")  # Ray's token auth, with this cluster's token
    ray.init(address=state["ray_address"], namespace=NAMESPACE, log_to_driver=False)
    try:
        yield addrs, ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    finally:
        ray.shutdown()
        cli("down", env=env, timeout=180)
