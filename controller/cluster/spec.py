"""What a starjar cluster runs: one ClusterSpec, validated once, passed to every actor as a dict.

Also the names everything is found by: the Ray namespace, the actor names and
the environment a local Ray cluster needs on a single host.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from controller.cluster.settings import build_config
from controller.frontend.limits import (
    DEFAULT_MAX_REQUESTS,
    DEFAULT_REQUEST_TIMEOUT_S,
    HttpLimits,
    check_max_requests,
    check_request_timeout,
)
from draft_server.config import MODES, DraftServerConfig
from starjar.errors import InvalidArgument
from starjar.service.security import MIN_TOKEN_CHARS
from target_worker.admission import DEFAULT_MAX_WAITING

NAMESPACE = "starjar"
CONTROLLER = "starjar-controller"
FRONTEND = "starjar-frontend"
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # starjar.model.loading.DTYPES, without torch
READY_TIMEOUT_S = 900.0  # `up`: until every actor serves, loading the models on every node included


# A single-host cluster: Ray on loopback. Its control plane requires Ray's own token (local_ray_env): any local
# process that reaches the GCS could otherwise run code in the cluster and read its secrets.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
RAY_TOKEN_FILE = "ray_auth_token"  # in the run directory, beside spec.json; a fresh one per local cluster


def run_dir() -> Path:
    """Where a local cluster keeps its state, spec and token files ($STARJAR_HOME/run)."""
    root = Path(os.environ.get("STARJAR_HOME") or Path.home() / ".cache" / "starjar")
    return root / "run"


def local_ray_env(run: str | os.PathLike | None = None) -> dict[str, str]:
    """Set os.environ for a process that starts or joins the local cluster whose run directory is `run`
    ($STARJAR_HOME/run by default): Ray's token authentication on, its token read from the file there.
    Call it before ray.init (Ray reads these there, and every process Ray starts inherits them). Returns the
    Ray variables, for a subprocess's environment."""
    if run is None:
        run = run_dir()
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    # Ray prefers RAY_AUTH_TOKEN to the file: one meant for another cluster must not stand in for this one's.
    os.environ.pop("RAY_AUTH_TOKEN", None)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(run).resolve() / RAY_TOKEN_FILE)}
    os.environ.update(auth)
    reload_ray_auth()
    return {**{k: os.environ[k] for k in LOCAL_RAY_ENV}, **auth}


def reload_ray_auth() -> None:
    """Ray caches its auth mode and token per process: one that has loaded Ray already (a test joining one
    cluster after another) must re-read them; not while connected, where they are in use. The config first:
    Ray's own tests reset them in this order."""
    ray = sys.modules.get("ray")
    if ray is not None and not ray.is_initialized():
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


@dataclass
class ClusterSpec:
    target: str  # target model directory (on every target node)
    draft: str | None  # draft model directory; None = no draft server, targets decode alone
    targets: int = 2  # target workers
    gamma: int = 1  # draft tokens per step; with a planner policy, the largest gamma it may pick
    policy: str = "fixed"  # fixed, or a name of starjar.spec.policies (see policy_help)
    profile: str | None = None  # `starjar profile` JSON (C_switch, T(n), D0) for nightjar and tide
    buckets: str | None = None  # nightjar's batch-size buckets, "1,2,4,8" (default: octaves 1,2,4,...,128)
    batch_size: int = 8  # running requests per target worker
    max_waiting: int = DEFAULT_MAX_WAITING  # requests queued per worker beyond its batch; then queue_full
    draft_mode: str = DraftServerConfig.mode  # batched | fifo
    max_targets: int = DraftServerConfig.max_targets  # N_max on each draft server (admission "auto": its bound)
    draft_servers: int = 1  # draft server actors; the controller assigns each target to one (draft_assignment)
    autoscale_drafts: str | None = None  # "MIN..MAX": the controller adds and retires draft servers (draft_autoscale)
    admission: str = "fixed"  # fixed: N_max = max_targets | auto: the controller recomputes N_max (StarSD 4.2)
    saturation_guard: bool = True  # the controller forces gamma = 0 while a saturated draft makes steps slower
    draft_deadline_s: float = 0.5
    threads: int = 1  # torch threads per target worker (and per draft server unless draft_threads is set)
    draft_threads: int | None = None
    device: str = "auto"  # auto (cuda when the actor got a GPU) | cpu | cuda
    dtype: str = "float32"
    host: str = "127.0.0.1"  # where the front end listens
    grpc_port: int = 50051
    http_port: int = 8000
    auth_token: str | None = None  # required as "Bearer <token>" by the front end when set
    # The cluster's own secret: every internal RPC (front end -> targets -> draft server) carries it, and
    # every actor's server requires it. `starjar up` generates one unless --auth-token-file names it.
    cluster_token: str | None = None
    max_requests: int = DEFAULT_MAX_REQUESTS  # requests the front end relays at once; then front_end_full
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # the longest one request may take at the front end
    metrics: bool = True  # a Prometheus endpoint in every actor
    prometheus_sd: str | None = None  # file-SD JSON the controller keeps current (on the head node)
    drain_timeout_s: float = 30.0  # on `starjar down`: how long generations in flight may take to finish
    tree: str | None = None  # token trees: a starjar.spec.tree_select.TREE_CHOICES name; None = chains
    tree_width: int = 3  # W_max: the draft's beam width
    tree_cap: int = 16  # most nodes one sequence verifies per step
    # Tokens per verification pass: `up` fills it from the profile's verify_budget; None = each target
    # worker measures it at start.
    tree_budget: int | None = None
    # Overrides of the draft servers' DraftServerConfig fields and the OpenAI port's HttpLimits fields, by field
    # name (controller.cli.config_flags: the flags that set them); the dataclasses hold the defaults.
    draft_server: dict = field(default_factory=dict)
    http: dict = field(default_factory=dict)

    def validate(self) -> ClusterSpec:
        if not os.path.isdir(self.target):
            raise InvalidArgument("--target", "must be a model directory", self.target)
        if self.draft is not None and not os.path.isdir(self.draft):
            raise InvalidArgument("--draft", "must be a model directory", self.draft)
        if not 1 <= self.targets <= 64:
            raise InvalidArgument("--targets", "must be in [1, 64]", self.targets)
        if not 0 <= self.gamma <= 16:
            raise InvalidArgument("--gamma", "must be in [0, 16]", self.gamma)
        from starjar.spec.policies import NAMES

        if self.policy != "fixed" and self.policy not in NAMES and not self.policy.startswith("fixed_"):
            raise InvalidArgument("--policy", f"fixed or one of {', '.join(NAMES)}", self.policy)
        from starjar.spec.policies import parse_buckets

        parse_buckets(self.buckets)
        if self.profile is not None and not os.path.isfile(self.profile):
            raise InvalidArgument("--profile", "must be a file written by `starjar profile`", self.profile)
        if not 1 <= self.batch_size <= 256:
            raise InvalidArgument("--batch-size", "must be in [1, 256]", self.batch_size)
        if self.max_waiting < 0:
            raise InvalidArgument("--max-waiting", "must be >= 0", self.max_waiting)
        check_max_requests(self.max_requests)
        check_request_timeout(self.request_timeout_s)
        if self.draft_mode not in MODES:
            raise InvalidArgument("--draft-mode", "must be batched or fifo", self.draft_mode)
        if self.admission not in ("fixed", "auto"):
            raise InvalidArgument("--admission", "must be fixed or auto", self.admission)
        if not 1 <= self.max_targets <= 4096:  # the draft server's own bound (DraftServerConfig)
            raise InvalidArgument("--max-targets", "must be in [1, 4096]", self.max_targets)
        if str(self.dtype).lower() not in DTYPE_NAMES:  # checked here: in the actors it costs a 15-minute wait
            raise InvalidArgument("--dtype", f"one of {', '.join(DTYPE_NAMES)}", self.dtype)
        if self.auth_token is not None and len(self.auth_token) < MIN_TOKEN_CHARS:
            raise InvalidArgument("--auth-token", f"a token must have at least {MIN_TOKEN_CHARS} characters",
                                  f"{len(self.auth_token)}")
        if not 1 <= self.draft_servers <= 64:
            raise InvalidArgument("--draft-servers", "must be in [1, 64]", self.draft_servers)
        if self.autoscale_drafts is not None:
            from controller.fleet.autoscale import parse_range

            lo, hi = parse_range(self.autoscale_drafts)
            if not lo <= self.draft_servers <= hi:
                raise InvalidArgument("--draft-servers", f"must be within --autoscale-drafts {lo}..{hi}",
                                      self.draft_servers)
        if self.draft_threads is not None and self.draft_threads < 1:
            raise InvalidArgument("--draft-threads", "must be >= 1", self.draft_threads)
        if self.threads < 1:
            raise InvalidArgument("--threads", "must be >= 1", self.threads)
        if self.device not in ("auto", "cpu", "cuda"):
            raise InvalidArgument("--device", "must be auto, cpu or cuda", self.device)
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise InvalidArgument(f"--{name.replace('_', '-')}", "must be in [0, 65535]", getattr(self, name))
        if not 0 <= self.drain_timeout_s <= 3600:
            raise InvalidArgument("--drain-timeout", "must be in [0, 3600] seconds", self.drain_timeout_s)
        self._validate_tree()
        self.draft_server_config()
        self.http_limits()
        return self

    def draft_server_config(self, host: str = "127.0.0.1"):
        """Each draft server's config: the spec's own settings, then the overrides."""
        return build_config(DraftServerConfig, host=host, port=0, mode=self.draft_mode, max_targets=self.max_targets,
                            **self.draft_server)

    def http_limits(self):
        return build_config(HttpLimits, **self.http)

    def _validate_tree(self) -> None:
        from starjar.spec.token_tree import MAX_TREE_NODES
        from starjar.spec.tree_select import TREE_CHOICES

        if self.tree is not None and self.tree not in TREE_CHOICES:
            raise InvalidArgument("--tree", f"one of {', '.join(TREE_CHOICES)}", self.tree)
        for name, lo, hi in (("tree_width", 1, 16), ("tree_cap", 1, MAX_TREE_NODES), ("tree_budget", 1, 4096)):
            value = getattr(self, name)
            if value is not None and not lo <= value <= hi:
                raise InvalidArgument("--" + name.replace("_", "-"), f"must be in [{lo}, {hi}]", value)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ClusterSpec:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
