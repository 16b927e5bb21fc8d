"""`python -m controller.cluster.keeper SPEC.json STATE.json`: the process that owns a local cluster.

`starjar up` (local_cluster.start_local) starts it in its own session and
reads its stdout, one JSON line per message: {"progress": ...} while actors
start, then {"ready": addresses} or {"error": ...}. The keeper runs
ray.init(), creates the controller, writes the state file, and holds the
cluster until SIGTERM (`starjar down`), when it drains the cluster and
ray.shutdown() takes every Ray process it started with it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from controller.cluster.omp_env import share_cores
from controller.cluster.spec import CONTROLLER, NAMESPACE, READY_TIMEOUT_S, ClusterSpec, local_ray_env


def _say(**msg) -> None:
    print(json.dumps(msg), flush=True)


def _catch_stop(stop: threading.Event) -> None:
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())


def _draft_slots(spec: ClusterSpec) -> int:
    """starjar_draft slots this machine offers: as many draft servers as the cluster may run."""
    if spec.autoscale_drafts:
        from controller.fleet.autoscale import parse_range

        return max(spec.draft_servers, parse_range(spec.autoscale_drafts)[1])
    return spec.draft_servers


def _start_ray(spec: ClusterSpec, stop: threading.Event) -> None:
    import ray

    _say(progress="starting Ray (local, loopback only, token authentication)")
    ray.init(namespace=NAMESPACE, include_dashboard=False, num_cpus=os.cpu_count(), num_gpus=None,
             resources={"starjar_draft": _draft_slots(spec), "starjar_target": spec.targets},
             _node_ip_address="127.0.0.1",
             # starjar passes no large objects through Ray: a small object store spares memory and /dev/shm.
             object_store_memory=200 * 1024 * 1024, log_to_driver=False)
    _catch_stop(stop)  # ray.init installs a handler that dies at once on SIGTERM; ours drains first


def _wait_ready(ctl, stop: threading.Event) -> dict:
    """The controller's addresses once the cluster serves; each change of the actors' states said meanwhile."""
    import ray

    ready = ctl.wait_ready.remote(READY_TIMEOUT_S)
    last = ""
    while not ray.wait([ready], timeout=2.0)[0]:
        if stop.is_set():
            raise KeyboardInterrupt
        st = ray.get(ctl.status.remote(), timeout=10)["actors"]
        line = ", ".join(f"{n.removeprefix('starjar-')} {'up' if a['live'] else '...'}" for n, a in st.items())
        if line != last:
            _say(progress=line)
            last = line
    return ray.get(ready)


def _write_state(state_file: str, addrs: dict, spec: ClusterSpec) -> None:
    import psutil
    import ray

    pids = [p.pid for p in psutil.Process().children(recursive=True)]
    state = {"keeper_pid": os.getpid(), "ray_address": ray.get_runtime_context().gcs_address,
             "addresses": addrs, "pids": pids, "started": time.time(), "drain_timeout_s": spec.drain_timeout_s}
    tmp = Path(state_file + ".tmp")
    tmp.unlink(missing_ok=True)  # owner-only from its first byte, whatever the umask: it names the GCS
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(json.dumps(state, indent=1))
    tmp.replace(state_file)  # atomic: `starjar down` never reads half a file


def _drain_and_stop(ctl, drain_timeout_s: float) -> None:
    """Let generations in flight finish (see Controller.drain), then stop the actors before Ray goes."""
    import ray

    print(f"draining generations in flight (at most {drain_timeout_s:.0f} s)", file=sys.stderr, flush=True)
    try:
        drained = ray.get(ctl.shutdown.remote(), timeout=drain_timeout_s + 60)
        print(f"drained: {drained}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - Ray's shutdown still takes every process with it
        print(f"drain failed: {exc!r}", file=sys.stderr, flush=True)


def _hold(spec: ClusterSpec, state_file: str, stop: threading.Event) -> None:
    """Start the cluster, say where it is, keep it until told to stop, then drain it."""
    import ray

    from controller.cluster.controller_actor import HEAD, Controller, actor_options

    _start_ray(spec, stop)
    _say(progress=f"loading models: draft server {'on' if spec.draft else 'off'}, {spec.targets} target "
                  "worker(s), front end")
    ctl = ray.remote(Controller).options(**actor_options(CONTROLLER, HEAD)).remote(spec.to_dict())
    addrs = _wait_ready(ctl, stop)
    _write_state(state_file, addrs, spec)
    _say(ready=addrs)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # `starjar up` has gone; nothing must write to its closed pipe
    while not stop.wait(1.0):
        pass
    _drain_and_stop(ctl, spec.drain_timeout_s)


def keeper_main(spec_path: str, state_file: str) -> int:
    """The keeper process: owns the local Ray cluster until SIGTERM."""
    local_ray_env(Path(spec_path).parent)  # Ray's token auth, with the token start_local wrote beside the spec
    share_cores()  # Ray's workers inherit it
    stop = threading.Event()
    _catch_stop(stop)
    spec = ClusterSpec.from_dict(json.loads(Path(spec_path).read_text()))
    try:
        _hold(spec, state_file, stop)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        import traceback

        traceback.print_exc()
        _say(error=str(exc))
        return 1
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(keeper_main(sys.argv[1], sys.argv[2]))
