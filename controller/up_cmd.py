"""`starjar up` / `starjar down`: a starjar cluster on Ray, in one command.

Without --address, `up` starts a private local Ray cluster on this machine,
owned by one background process (the keeper): it runs ray.init(), creates the
controller, and holds the cluster until `starjar down` sends it SIGTERM, when
ray.shutdown() takes every Ray process it started with it. A state file
($STARJAR_HOME/run/cluster.json) says where the keeper and the cluster are.
With --address (a cluster from `ray up`), `up` creates the detached actors
there and returns; `down --address` stops them.

Either way `down` (and SIGTERM to the keeper) drains first: new generations
are refused (UNAVAILABLE "draining", HTTP 503) while those in flight finish,
for at most --drain-timeout seconds; only then do the actors go.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from controller.cluster_spec import CONTROLLER, NAMESPACE, ClusterSpec, local_ray_env
from starjar.errors import InvalidArgument, StarjarError
from starjar.security import read_token

READY_TIMEOUT_S = 900.0


def run_dir() -> Path:
    root = Path(os.environ.get("STARJAR_HOME") or Path.home() / ".cache" / "starjar")
    return root / "run"


def state_path() -> Path:
    return run_dir() / "cluster.json"


def add_up_parsers(sub) -> None:
    u = sub.add_parser("up", help="start a starjar cluster on Ray (local by default) and print its addresses")
    u.add_argument("--target", help="target model directory (default: the default pair's target)")
    u.add_argument("--draft", help="draft model directory (default: the default pair's draft)")
    u.add_argument("--no-draft", action="store_true", help="no draft server: targets decode alone")
    u.add_argument("--targets", type=int, default=2, help="target workers (default 2)")
    u.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per step, forced (default: adaptive, as `starjar models build` measured on "
                        "this machine); with --policy other than fixed: the largest gamma")
    u.add_argument("--policy", default=None,
                   help="fixed, nightjar, nightjar_paper, dsd, banditspec, tide, vllm_table, sglang_ema, "
                        "hf_heuristic (default: nightjar, or fixed when --gamma is given)")
    u.add_argument("--profile", default=None, help="latency tables from `starjar profile` (nightjar, tide)")
    u.add_argument("--buckets", default=None, help="nightjar's batch-size buckets, e.g. 1,2,4,8,16 "
                   "(default: octaves 1,2,4,...,128)")
    u.add_argument("--batch-size", type=int, default=8, help="running requests per target (default 8)")
    u.add_argument("--draft-mode", default="batched", choices=["batched", "fifo"])
    u.add_argument("--max-targets", type=int, default=8, help="N_max on the draft server (its cap with auto)")
    u.add_argument("--admission", default="fixed", choices=["fixed", "auto"],
                   help="auto: the controller recomputes N_max from measured Z, S and speeds (StarSD 4.2)")
    u.add_argument("--no-saturation-guard", action="store_true",
                   help="never force gamma = 0 when the draft server is saturated (default: the controller does, "
                   "for 30 s at a time, while speculative steps make fewer tokens/s than plain ones)")
    u.add_argument("--threads", type=int, default=1, help="torch threads per target worker (default 1)")
    u.add_argument("--draft-threads", type=int, default=None, help="torch threads of the draft server "
                   "(default: --threads)")
    u.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    u.add_argument("--dtype", default="float32")
    u.add_argument("--host", default="127.0.0.1", help="front end listen address (0.0.0.0 on a real cluster)")
    u.add_argument("--grpc-port", type=int, default=50051, help="front end gRPC port (0 = any free)")
    u.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0 = any free)")
    u.add_argument("--auth-token", default=os.environ.get("STARJAR_AUTH_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default $STARJAR_AUTH_TOKEN; none)")
    u.add_argument("--auth-token-file", default=None,
                   help="the cluster's internal secret (every actor's port requires it; default: a new random "
                        "one per cluster, which nobody outside the cluster needs)")
    u.add_argument("--max-waiting", type=int, default=None,
                   help="requests queued per target worker beyond its batch; then queue_full (default 256)")
    u.add_argument("--max-requests", type=int, default=None,
                   help="requests the front end relays at once; then 429 / RESOURCE_EXHAUSTED (default 1024)")
    u.add_argument("--request-timeout", type=float, default=None,
                   help="the longest one request may take at the front end, queueing included (default 600 s)")
    u.add_argument("--address", help="an existing Ray cluster (e.g. auto, after `ray up`) instead of a local one")
    u.add_argument("--prometheus-sd", default=None,
                   help="file-SD JSON for Prometheus, kept current by the controller "
                        "(default $STARJAR_HOME/run/prometheus_sd.json for a local cluster)")
    u.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoints")
    u.add_argument("--json", action="store_true", help='print {"grpc", "http", "metrics"} once serving')
    u.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on `starjar down`: seconds generations in flight may take to finish while new ones are "
                        "refused (default 30)")
    d = sub.add_parser("down", help="stop the cluster `starjar up` started")
    d.add_argument("--address", help="the Ray cluster given to `starjar up --address`")


def local_spec(target: str | None = None, draft: str | None = None, no_draft: bool = False,
               **fields) -> ClusterSpec:
    """A validated ClusterSpec; a missing target or draft is the default pair's (built offline if needed)."""
    if target is None or (draft is None and not no_draft):
        from starjar.default_pair import build_default_pair

        pair = build_default_pair()
        target = target or pair["target"]
        draft = draft or pair["draft"]
    fields.setdefault("prometheus_sd", str(run_dir() / "prometheus_sd.json"))
    if not fields.get("cluster_token"):  # no internal port is ever open: a fresh secret per cluster
        fields["cluster_token"] = secrets.token_urlsafe(32)
    return ClusterSpec(target=os.path.abspath(target), draft=None if no_draft else os.path.abspath(draft),
                       **fields).validate()


def adaptive_defaults(target: str | None, draft: str | None, no_draft: bool, gamma: int | None,
                      policy: str | None):
    """The speculation a cluster runs when the user forces none: measured on this machine (see spec_defaults).
    The default pair is measured now if `starjar models build` has not measured it here yet."""
    from controller.spec_defaults import speculation_defaults

    measure = target is None and draft is None and not no_draft
    if target is None or (draft is None and not no_draft):
        from starjar.default_pair import build_default_pair

        pair = build_default_pair()
        target, draft = target or pair["target"], draft or pair["draft"]
    chosen = speculation_defaults(None if no_draft else draft, gamma, policy, measure=measure, target_dir=target)
    print(f"speculation: {chosen.note}", file=sys.stderr)
    return chosen


def _spec(args) -> ClusterSpec:
    """`starjar up`'s flags as a ClusterSpec."""
    sd = os.path.abspath(args.prometheus_sd) if args.prometheus_sd else None
    spec_on = adaptive_defaults(args.target, args.draft, args.no_draft, args.gamma, args.policy)
    return local_spec(args.target, args.draft, args.no_draft, targets=args.targets, gamma=spec_on.gamma,
                      policy=spec_on.policy, profile=os.path.abspath(args.profile) if args.profile else None,
                      buckets=args.buckets, batch_size=args.batch_size, draft_mode=args.draft_mode,
                      max_targets=args.max_targets, admission=args.admission,
                      saturation_guard=not args.no_saturation_guard, threads=args.threads,
                      draft_threads=args.draft_threads, device=args.device, dtype=args.dtype, host=args.host,
                      grpc_port=args.grpc_port, http_port=args.http_port, auth_token=args.auth_token,
                      metrics=not args.no_metrics, drain_timeout_s=args.drain_timeout,
                      cluster_token=read_token(args.auth_token_file) if args.auth_token_file else None,
                      **{k: v for k, v in (("max_waiting", args.max_waiting), ("max_requests", args.max_requests),
                                           ("request_timeout_s", args.request_timeout)) if v is not None},
                      # On a cluster of someone else's (--address) there is no local file to keep current.
                      prometheus_sd=sd if sd or not args.address else None)


def _print_ready(addrs: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(addrs), flush=True)
        return
    print(f"starjar is serving\n  gRPC    {addrs['grpc']}   (from starjar import Client)\n"
          f"  HTTP    {addrs['http']}/v1   (OpenAI-compatible)\n"
          f"  metrics {', '.join(addrs['metrics']) or '-'}\nstop it with: starjar down", flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state() -> dict | None:
    """The running local cluster's state file, or None (a stale file of a dead keeper is removed)."""
    path = state_path()
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    if not _alive(state["keeper_pid"]):
        path.unlink(missing_ok=True)
        return None
    return state


def run_up(args) -> int:
    spec = _spec(args)
    if args.address:
        return _up_remote(spec, args)
    _print_ready(start_local(spec), args.json)
    return 0


def start_local(spec: ClusterSpec) -> dict:
    """Start the keeper, show its progress on stderr, return the addresses once everything serves."""
    state = read_state()
    if state is not None:
        raise StarjarError(f"a starjar cluster is already running (keeper pid {state['keeper_pid']}); "
                           "run `starjar down` first")
    path = state_path()
    run_dir().mkdir(parents=True, exist_ok=True)
    log_path = run_dir() / "cluster.log"
    spec_path = run_dir() / "spec.json"
    spec_path.write_text(json.dumps(spec.to_dict()))
    os.chmod(spec_path, 0o600)  # may hold the auth token
    with open(log_path, "ab") as log_file:
        keeper = subprocess.Popen([sys.executable, "-m", "controller.keeper", str(spec_path), str(path)],
                                  stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                  start_new_session=True, text=True)
    t0 = time.time()
    for line in keeper.stdout:
        msg = json.loads(line)
        if "progress" in msg:
            print(f"[{time.time() - t0:5.1f}s] {msg['progress']}", file=sys.stderr, flush=True)
        elif "ready" in msg:
            keeper.stdout.close()
            return msg["ready"]
        elif "error" in msg:
            break
    keeper.wait(timeout=60)
    raise StarjarError(f"the cluster did not start; see {log_path}:\n" + _tail(log_path))


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _up_remote(spec: ClusterSpec, args) -> int:
    import ray

    from controller.controller_actor import HEAD, Controller, _options

    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    ctl = ray.remote(Controller).options(**_options(CONTROLLER, HEAD)).remote(spec.to_dict())
    print("waiting for the draft server, target workers and front end ...", file=sys.stderr, flush=True)
    _print_ready(ray.get(ctl.wait_ready.remote(READY_TIMEOUT_S)), args.json)
    return 0


def run_down(args) -> int:
    if args.address:
        import ray

        ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
        try:
            ctl = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        except ValueError:
            print("no starjar cluster on this Ray cluster", file=sys.stderr)
            return 0
        drain_s = ray.get(ctl.describe.remote(), timeout=60).get("drain_timeout_s", 30.0)
        print(f"draining generations in flight (at most {drain_s:.0f} s) ...", file=sys.stderr, flush=True)
        ray.get(ctl.shutdown.remote(), timeout=drain_s + 60)
        ray.kill(ctl, no_restart=True)
        print("starjar actors stopped")
        return 0
    state = read_state()
    if state is not None:
        print(f"draining generations in flight (at most {state.get('drain_timeout_s', 30.0):.0f} s) ...",
              file=sys.stderr, flush=True)
    stopped = stop_local()
    if stopped is None:
        print("no local starjar cluster is running", file=sys.stderr)
    else:
        print(f"starjar cluster stopped ({stopped[0]} processes{f', {stopped[1]} killed' if stopped[1] else ''})")
    return 0


def stop_local() -> tuple[int, int] | None:
    """SIGTERM the keeper, wait for every process of the cluster to end; (processes, killed), or None."""
    path = state_path()
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    keeper = state["keeper_pid"]
    pids = set(state.get("pids", [])) | set(_descendants(keeper))  # actors restarted since `up` included
    if _alive(keeper):
        os.kill(keeper, signal.SIGTERM)  # the keeper drains the cluster, then shuts Ray down
    left = _wait_gone([keeper, *pids], state.get("drain_timeout_s", 30.0) + 60.0)
    for pid in left:  # what ray.shutdown() did not take with it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    path.unlink(missing_ok=True)
    return len(pids) + 1, len(left)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = [p for p in pids if _alive(p) and not _is_zombie(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p) and not _is_zombie(p)]


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


def _is_zombie(pid: int) -> bool:
    try:
        import psutil

        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except Exception:
        return False


def _drain_and_stop(ctl, drain_timeout_s: float) -> None:
    """Let generations in flight finish (see Controller.drain), then stop the actors before Ray goes."""
    import ray

    print(f"draining generations in flight (at most {drain_timeout_s:.0f} s)", file=sys.stderr, flush=True)
    try:
        drained = ray.get(ctl.shutdown.remote(), timeout=drain_timeout_s + 60)
        print(f"drained: {drained}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - Ray's shutdown still takes every process with it
        print(f"drain failed: {exc!r}", file=sys.stderr, flush=True)


def keeper_main(spec_path: str, state_file: str) -> int:
    """The keeper process: owns the local Ray cluster until SIGTERM."""
    local_ray_env()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    def say(**msg) -> None:
        print(json.dumps(msg), flush=True)

    stop = threading.Event()

    def on_signal() -> None:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())

    on_signal()
    spec = ClusterSpec.from_dict(json.loads(Path(spec_path).read_text()))
    try:
        import psutil
        import ray

        from controller.controller_actor import HEAD, Controller, _options

        say(progress="starting Ray (local, loopback only)")
        ray.init(namespace=NAMESPACE, include_dashboard=False, num_cpus=os.cpu_count(), num_gpus=None,
                 resources={"starjar_draft": 1, "starjar_target": spec.targets}, _node_ip_address="127.0.0.1",
                 # starjar passes no large objects through Ray: a small object store spares memory and /dev/shm.
                 object_store_memory=200 * 1024 * 1024, log_to_driver=False)
        on_signal()  # ray.init installs a handler that dies at once on SIGTERM; ours drains first
        say(progress=f"loading models: draft server {'on' if spec.draft else 'off'}, {spec.targets} target "
                     "worker(s), front end")
        ctl = ray.remote(Controller).options(**_options(CONTROLLER, HEAD)).remote(spec.to_dict())
        ready = ctl.wait_ready.remote(READY_TIMEOUT_S)
        last = ""
        while True:
            done, _ = ray.wait([ready], timeout=2.0)
            if done:
                break
            if stop.is_set():
                raise KeyboardInterrupt
            st = ray.get(ctl.status.remote(), timeout=10)["actors"]
            line = ", ".join(f"{n.removeprefix('starjar-')} {'up' if a['live'] else '...'}" for n, a in st.items())
            if line != last:
                say(progress=line)
                last = line
        addrs = ray.get(ready)
        pids = [p.pid for p in psutil.Process().children(recursive=True)]
        state = {"keeper_pid": os.getpid(), "ray_address": ray.get_runtime_context().gcs_address,
                 "addresses": addrs, "pids": pids, "started": time.time(), "drain_timeout_s": spec.drain_timeout_s}
        tmp = Path(state_file + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(state_file)
        say(ready=addrs)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # `starjar up` has gone; nothing must write to its closed pipe
        while not stop.wait(1.0):
            pass
        _drain_and_stop(ctl, spec.drain_timeout_s)
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        import traceback

        traceback.print_exc()
        say(error=str(exc))
        return 1
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:
            pass
    return 0
