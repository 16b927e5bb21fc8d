"""`starjar up` / `starjar down`: a starjar cluster on Ray, in one command.

Without --address, `up` starts a private local Ray cluster on this machine,
owned by one background process (the keeper, see local_cluster and keeper):
it holds the cluster until `starjar down`. With --address (a cluster from
`ray up`), `up` creates the detached actors there and returns; `down
--address` stops them (see remote_cluster).

Either way `down` (and SIGTERM to the keeper) drains first: new generations
are refused (UNAVAILABLE "draining", HTTP 503) while those in flight finish,
for at most --drain-timeout seconds; only then do the actors go.
"""

from __future__ import annotations

import json
import os
import sys

from controller.cli.config_flags import DRAFT_SERVER_FLAGS, HTTP_FLAGS, add_config_flags, config_overrides
from controller.cli.flags import add_tree_flags, tree_speculation
from controller.cluster.local import adaptive_defaults, local_spec, read_state, start_local, stop_local
from controller.cluster.spec import ClusterSpec
from controller.frontend.limits import HttpLimits
from draft_server.config import MODES, DraftServerConfig
from starjar.service.security import read_token
from starjar.spec.policies import policy_help


def add_up_parsers(sub) -> None:
    _add_up_parser(sub)
    d = sub.add_parser("down", help="stop the cluster `starjar up` started")
    d.add_argument("--address", help="the Ray cluster given to `starjar up --address`")


def _add_up_parser(sub) -> None:
    u = sub.add_parser("up", help="start a starjar cluster on Ray (local by default) and print its addresses")
    u.add_argument("--target", help="target model directory (default: the default pair's target)")
    u.add_argument("--draft", help="draft model directory (default: the default pair's draft)")
    u.add_argument("--no-draft", action="store_true", help="no draft server: targets decode alone")
    u.add_argument("--targets", type=int, default=2, help="target workers (default 2)")
    u.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per step, forced (default: adaptive, as `starjar models build` measured on "
                        "this machine); with --policy other than fixed: the largest gamma")
    u.add_argument("--policy", default=None, help=policy_help("nightjar, or fixed when --gamma is given"))
    u.add_argument("--profile", default=None, help="latency tables from `starjar profile` (nightjar, tide)")
    u.add_argument("--buckets", default=None, help="nightjar's batch-size buckets, e.g. 1,2,4,8,16 "
                   "(default: octaves 1,2,4,...,128)")
    u.add_argument("--batch-size", type=int, default=8, help="running requests per target (default 8)")
    u.add_argument("--draft-mode", default=DraftServerConfig.mode, choices=MODES)
    u.add_argument("--max-targets", type=int, default=DraftServerConfig.max_targets,
                   help=f"N_max on each draft server (its cap with auto; default {DraftServerConfig.max_targets})")
    u.add_argument("--autoscale-drafts", default=None, metavar="MIN..MAX",
                   help="add a draft server while targets wait for one (every one at N_max or saturated), retire "
                        "one (drain, then stop) when the others can carry its targets; starts with --draft-servers "
                        "(default MIN)")
    u.add_argument("--draft-servers", type=int, default=None,
                   help="draft server actors (default 1); each target speculates with one (same tokenizer, least "
                        "loaded, under its N_max) and moves to another at once if its own dies")
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
    _add_endpoint_flags(u)
    add_config_flags(u, DraftServerConfig, DRAFT_SERVER_FLAGS, "draft servers")
    add_config_flags(u, HttpLimits, HTTP_FLAGS, "OpenAI HTTP port limits")
    add_tree_flags(u)


def _add_endpoint_flags(u) -> None:
    """Where the cluster listens, who may call it, and what it tells Prometheus."""
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
    u.add_argument("--prometheus-sd", default=None, metavar="PATH",
                   help="file-SD JSON for Prometheus, kept current by the controller as actors start, move and "
                        "stop, with metrics.token beside it (the cluster token every metrics endpoint requires). "
                        "A local cluster's are owner-only (0600) and removed by `starjar down`. Default: "
                        "$STARJAR_HOME/run/prometheus_sd.json for a local cluster ($STARJAR_HOME: "
                        "~/.cache/starjar unless set); none with --address")
    u.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoints")
    u.add_argument("--json", action="store_true", help='print {"grpc", "http", "metrics"} once serving')
    u.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on `starjar down`: seconds generations in flight may take to finish while new ones are "
                        "refused (default 30)")


def _spec(args) -> ClusterSpec:
    """`starjar up`'s flags as a ClusterSpec."""
    sd = os.path.abspath(args.prometheus_sd) if args.prometheus_sd else None
    gamma, policy = tree_speculation(args.tree, args.gamma, args.policy)
    spec_on = adaptive_defaults(args.target, args.draft, args.no_draft, gamma, policy)
    return local_spec(args.target, args.draft, args.no_draft, targets=args.targets, gamma=spec_on.gamma,
                      policy=spec_on.policy, profile=os.path.abspath(args.profile) if args.profile else None,
                      buckets=args.buckets, batch_size=args.batch_size, draft_mode=args.draft_mode,
                      max_targets=args.max_targets,
                      draft_servers=_draft_servers(args),
                      autoscale_drafts=args.autoscale_drafts, admission=args.admission,
                      saturation_guard=not args.no_saturation_guard, threads=args.threads,
                      draft_threads=args.draft_threads, device=args.device, dtype=args.dtype, host=args.host,
                      grpc_port=args.grpc_port, http_port=args.http_port, auth_token=args.auth_token,
                      metrics=not args.no_metrics, drain_timeout_s=args.drain_timeout,
                      cluster_token=read_token(args.auth_token_file) if args.auth_token_file else None,
                      **_tree_fields(args), draft_server=config_overrides(args, DRAFT_SERVER_FLAGS),
                      http=config_overrides(args, HTTP_FLAGS),
                      **{k: v for k, v in (("max_waiting", args.max_waiting), ("max_requests", args.max_requests),
                                           ("request_timeout_s", args.request_timeout)) if v is not None},
                      # Left out, a local cluster gets local_spec's default in its run directory; on a cluster of
                      # someone else's (--address) there is no local file to keep current.
                      **({"prometheus_sd": sd} if sd or args.address else {}))


def _tree_fields(args) -> dict:
    """--tree and its knobs for the spec; the verification budget from --profile's verify_budget when
    --tree-budget is not given (the target workers measure it at start when neither is)."""
    from starjar.spec.tree_select import trees_on
    from target_worker.tree_budget import profiled_budget

    budget = args.tree_budget
    if budget is None and trees_on(args.tree):
        budget = profiled_budget(os.path.abspath(args.profile) if args.profile else None)
    return {"tree": args.tree, "tree_width": args.tree_width, "tree_cap": args.tree_cap, "tree_budget": budget}


def _draft_servers(args) -> int:
    """--draft-servers, or the autoscaling range's MIN when only that is given."""
    if args.draft_servers is not None:
        return args.draft_servers
    if args.autoscale_drafts:
        from controller.fleet.autoscale import parse_range

        return parse_range(args.autoscale_drafts)[0]
    return 1


def _print_ready(addrs: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(addrs), flush=True)
        return
    print(f"starjar is serving\n  gRPC    {addrs['grpc']}   (from starjar import Client)\n"
          f"  HTTP    {addrs['http']}/v1   (OpenAI-compatible)\n"
          f"  metrics {', '.join(addrs['metrics']) or '-'}\nstop it with: starjar down", flush=True)


def run_up(args) -> int:
    spec = _spec(args)
    if args.address:
        from controller.cluster.remote import start_remote

        print("waiting for the draft server, target workers and front end ...", file=sys.stderr, flush=True)
        _print_ready(start_remote(spec, args.address), args.json)
        return 0
    _print_ready(start_local(spec), args.json)
    return 0


def _say_draining(seconds: float) -> None:
    print(f"draining generations in flight (at most {seconds:.0f} s) ...", file=sys.stderr, flush=True)


def run_down(args) -> int:
    if args.address:
        from controller.cluster.remote import stop_remote

        if stop_remote(args.address, on_drain=_say_draining):
            print("starjar actors stopped")
        else:
            print("no starjar cluster on this Ray cluster", file=sys.stderr)
        return 0
    state = read_state()
    if state is not None:
        _say_draining(state.get("drain_timeout_s", 30.0))
    stopped = stop_local()
    if stopped is None:
        print("no local starjar cluster is running", file=sys.stderr)
    else:
        print(f"starjar cluster stopped ({stopped[0]} processes{f', {stopped[1]} killed' if stopped[1] else ''})")
    return 0
