"""`starjar serve draft|target`: one server process in the foreground.

When the server is listening it prints one JSON line on stdout,
{"serving": "draft"|"target", "address": "HOST:PORT"}, so scripts (and tests)
can start it on port 0 and learn the port.
"""

from __future__ import annotations

import json
import logging
import os

from controller.cli.config_flags import DRAFT_SERVER_FLAGS, add_config_flags, config_overrides
from controller.cli.flags import add_deprecated_alias, add_tree_flags, check_port, tree_speculation
from controller.cluster.settings import as_flag_error, build_config
from draft_server.config import MODES, DraftServerConfig
from starjar.errors import InvalidArgument
from starjar.spec.policies import policy_help
from target_worker.admission import DEFAULT_MAX_WAITING

log = logging.getLogger(__name__)


def add_serve_parsers(sub) -> None:
    s = sub.add_parser("serve", help="run a draft server or a target worker")
    ssub = s.add_subparsers(dest="serve_cmd", required=True)
    _add_draft_parser(ssub)
    _add_target_parser(ssub)


def _add_draft_parser(ssub) -> None:
    d = ssub.add_parser("draft", help="the gRPC draft server")
    d.add_argument("--model", help="draft model directory (default: the default pair's draft)")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=50061, help="0 = any free port")
    d.add_argument("--mode", default=DraftServerConfig.mode, choices=MODES,
                   help="batched: one draft pass for every pending round; fifo: one round at a time")
    d.add_argument("--max-targets", type=int, default=DraftServerConfig.max_targets,
                   help=f"N_max: targets admitted at once (default {DraftServerConfig.max_targets})")
    d.add_argument("--max-sequences-per-target", type=int, default=256, help="live sequences per target")
    add_deprecated_alias(d, "--max-sequences", "--max-sequences-per-target", "max_sequences_per_target", type=int)
    d.add_argument("--max-gamma", type=int, default=16)
    d.add_argument("--lease", type=float, default=60.0, help="seconds before unused sessions are reclaimed")
    d.add_argument("--offload-after", type=float, default=None,
                   help="offload the draft after this many seconds without rounds (default: never)")
    d.add_argument("--max-kv-tokens", type=int, default=None,
                   help="draft KV cache budget in tokens (live sequences x the longest); a sequence past it is "
                        "answered resync (default: a quarter of this machine's memory)")
    d.add_argument("--max-kv-tokens-per-target", type=int, default=None,
                   help="KV tokens one target may hold (default: twice its fair share, budget / N_max)")
    d.add_argument("--keepalive", type=float, default=20.0,
                   help="seconds between pings to each target; an unanswered ping ends its session (default 20)")
    d.add_argument("--stream-idle", type=float, default=600.0,
                   help="seconds a stream may send no round before it is ended (default 600)")
    d.add_argument("--adapt", action="store_true",
                   help="online draft adaptation (TIDE): learn from the targets' verified tokens in idle time, "
                        "in memory only; a target opts out at Attach (default: off)")
    d.add_argument("--adapt-collect-from-start", action="store_true",
                   help="with --adapt: collect training data from the first round (a cold start) instead of "
                        "waiting for acceptance to drop (TIDE's default)")
    d.add_argument("--adapt-train", default="",
                   help="with --adapt: trainer settings as name=value pairs, e.g. rank=64,lr=0.003 (fields of "
                        "draft_server.tide.config.TrainConfig; default: its defaults)")
    d.add_argument("--device", default="cpu")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    add_config_flags(d, DraftServerConfig, DRAFT_SERVER_FLAGS, "sharing between targets")
    add_security_flags(d)


def _add_target_parser(ssub) -> None:
    t = ssub.add_parser("target", help="a target worker with its own Generate service")
    t.add_argument("--model", help="target model directory (default: the default pair's target)")
    t.add_argument("--draft-server", help="draft server HOST:PORT (default: none, no speculation)")
    add_deprecated_alias(t, "--draft", "--draft-server", "draft_server")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=50071, help="0 = any free port")
    t.add_argument("--worker-id", default=None, help="name for the draft server (default: host:pid)")
    t.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per step, forced (default: adaptive, from the default pair's measurement on "
                        "this machine); with --policy other than fixed: the largest gamma it may pick")
    t.add_argument("--policy", default=None, help=policy_help("nightjar, or fixed when --gamma is given"))
    t.add_argument("--profile", default=None, help="latency tables from `starjar profile` (nightjar, tide)")
    t.add_argument("--buckets", default=None,
                   help="nightjar's batch-size buckets, e.g. 1,2,4,8,16 (default: octaves up to 128)")
    t.add_argument("--batch-size", type=int, default=16, help="running requests (default 16)")
    t.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests queued beyond a full batch; past that new ones are refused with "
                        f"RESOURCE_EXHAUSTED, reason queue_full (default {DEFAULT_MAX_WAITING})")
    t.add_argument("--draft-deadline", type=float, default=0.5, help="seconds to wait for drafts per step")
    t.add_argument("--device", default="cpu")
    t.add_argument("--dtype", default="float32")
    t.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    t.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds generations in flight may take to finish while new ones are refused "
                        "(default 30)")
    add_tree_flags(t)
    add_security_flags(t, client=True)


def add_security_flags(p, client: bool = False) -> None:
    g = p.add_argument_group("security (see README: Security)")
    g.add_argument("--auth-token-file", default=None,
                   help="the cluster token, required on every RPC as 'authorization: Bearer TOKEN' "
                        "(default: $STARJAR_AUTH_TOKEN; none: no auth, loopback only)")
    g.add_argument("--tls-cert", default=None, help="this server's certificate (PEM): serve TLS")
    g.add_argument("--tls-key", default=None, help="its private key (PEM)")
    g.add_argument("--tls-client-ca", default=None,
                   help="CA (PEM) whose certificates callers must show: mutual TLS")
    if client:
        g.add_argument("--tls-ca", default=None,
                       help="CA (PEM) that signed the draft server's certificate: call it over TLS "
                            "(with --tls-cert/--tls-key as this worker's client certificate)")
        g.add_argument("--tls-server-name", default=None,
                       help="the name in the draft server's certificate, when it is not the host of --draft-server")


def security_from(args):
    """The cluster token and TLS flags as a starjar.service.security.Security."""
    from starjar.service.security import Security, read_token

    return Security(token=read_token(args.auth_token_file), tls_cert=args.tls_cert, tls_key=args.tls_key,
                    tls_client_ca=args.tls_client_ca, tls_ca=getattr(args, "tls_ca", None),
                    server_name=getattr(args, "tls_server_name", None))


def _announce(kind: str, host: str, registry=None, metrics_port: int | None = None, token: str | None = None):
    """token: the cluster token, which the metrics endpoint then requires too."""
    def on_ready(port: int) -> None:
        msg = {"serving": kind, "address": f"{host}:{port}"}
        if registry is not None and metrics_port is not None:
            from starjar.service.metrics import serve

            msg["metrics"] = f"{host}:{serve(registry, host, metrics_port, token)}"
        print(json.dumps(msg), flush=True)
    return on_ready


def run_serve(args) -> int:
    check_port("--port", args.port)
    check_port("--metrics-port", args.metrics_port)
    return _run_draft(args) if args.serve_cmd == "draft" else _run_target(args)


def _draft_config(args):
    return build_config(DraftServerConfig, host=args.host, port=args.port, mode=args.mode,
                        max_targets=args.max_targets,
                        max_sequences_per_target=args.max_sequences_per_target, max_gamma=args.max_gamma,
                        lease_s=args.lease, offload_after_s=args.offload_after, max_kv_tokens=args.max_kv_tokens,
                        max_kv_tokens_per_target=args.max_kv_tokens_per_target, keepalive_s=args.keepalive,
                        stream_idle_s=args.stream_idle, tide=_tide_config(args),
                        **config_overrides(args, DRAFT_SERVER_FLAGS))


def _tide_config(args):
    from draft_server.tide.collect import CollectConfig
    from draft_server.tide.config import TideConfig, train_config_from

    if not args.adapt:
        return None
    return TideConfig(collect=CollectConfig(start_collecting=args.adapt_collect_from_start),
                      train=train_config_from(args.adapt_train))


def _run_draft(args) -> int:
    from draft_server.server import DraftServer
    from starjar.cpu.kernels import hand_threads_to_compute
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model
    from starjar.service.serving import run_until_signalled

    cfg = _draft_config(args)
    model = load_model(args.model or build_default_pair()["draft"], args.device, args.dtype, what="model")
    hand_threads_to_compute()  # the draft compute thread owns the cores from here
    security = security_from(args)
    server = DraftServer(model, cfg, security)
    run_until_signalled(server.start, server.stop,
                        _announce("draft", args.host, server.metrics.registry, args.metrics_port, security.token))
    return 0


def check_tree_flags(args) -> None:
    """--tree-width/--tree-cap/--tree-budget checked before any model loads."""
    from target_worker.tree_score import TreeConfig

    try:
        TreeConfig("adaserve", args.tree_width, 1 if args.tree_budget is None else args.tree_budget, args.tree_cap)
    except InvalidArgument as exc:
        raise as_flag_error(exc) from None


def _target_config(args, gamma: int, tree=None):
    from target_worker.config import TargetWorkerConfig, engine_config

    engine = engine_config(args.batch_size, gamma, tree=tree)
    try:
        return TargetWorkerConfig(worker_id=args.worker_id or f"{os.uname().nodename}:{os.getpid()}",
                                  draft_server=args.draft_server, host=args.host, port=args.port,
                                  draft_deadline_s=args.draft_deadline, drain_timeout_s=args.drain_timeout,
                                  max_waiting=args.max_waiting, exit_on_engine_death=True, engine=engine)
    except InvalidArgument as exc:
        raise as_flag_error(exc) from None


def _run_target(args) -> int:
    from controller.tuning.spec_defaults import speculation_defaults
    from starjar.cpu.kernels import hand_threads_to_compute
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model
    from starjar.spec.policies import parse_buckets, serving_policy
    from target_worker.server import TargetServer, serve_forever
    from target_worker.tree_budget import tree_config

    if args.gamma is not None and args.gamma < 0:
        raise InvalidArgument("--gamma", "must be >= 0", args.gamma)
    check_tree_flags(args)
    gamma, policy = tree_speculation(args.tree, args.gamma, args.policy)
    # The draft's files are on the draft server's host: with the default target, the default pair's measurement
    # on this machine stands for it; a target of the user's own has none (the planner explores).
    measured_draft = (build_default_pair()["draft"] if args.model is None else "") if args.draft_server else None
    chosen = speculation_defaults(measured_draft, gamma, policy)
    _target_config(args, chosen.gamma)  # every other flag checked before the model loads
    model = load_model(args.model or build_default_pair()["target"], args.device, args.dtype, what="model")
    tree, tree_note = tree_config(args.tree, args.tree_width, args.tree_cap, args.tree_budget, args.profile, model)
    cfg = _target_config(args, chosen.gamma, tree)
    log.info("speculation: %s; %s", chosen.note, tree_note)
    hand_threads_to_compute()  # the engine thread owns the cores from here
    policy = serving_policy(chosen.policy, chosen.gamma, args.profile, bool(args.draft_server),
                            parse_buckets(args.buckets))
    security = security_from(args)
    server = TargetServer(model, cfg, policy, security)
    serve_forever(server, _announce("target", args.host, server.metrics.registry, args.metrics_port, security.token))
    return 0
