"""Target worker settings, validated once at start: one TargetWorkerConfig per server, built by whoever starts
it (`starjar serve target`, the Ray actor, tests) and passed whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from starjar.errors import InvalidArgument
from target_worker.admission import DEFAULT_MAX_WAITING
from target_worker.engine import EngineConfig
from target_worker.tree_score import TreeConfig

# The engine's buffers hold at least this many draft tokens per step, whatever gamma is configured: a gamma
# forced later (the controller's set_gamma, `starjar demo`) then fits without restarting the engine.
MIN_GAMMA_ROOM = 8


def engine_config(max_batch_size: int, gamma: int, kv_budget_tokens: int | None = None,
                  tree: TreeConfig | None = None) -> EngineConfig:
    """The engine of a worker that speculates up to `gamma` draft tokens per step (a tree's depth), with token
    trees when `tree` is given."""
    return EngineConfig(max_batch_size=max_batch_size, kv_budget_tokens=kv_budget_tokens,
                        max_gamma=max(MIN_GAMMA_ROOM, gamma), tree=tree)


@dataclass(frozen=True)
class TargetWorkerConfig:
    worker_id: str = "target"  # its name for the draft server
    # The draft server: HOST:PORT, or a function that says where it is now (the Ray actor asks its
    # controller, so a restarted draft server on a new port is found again); None = never speculate.
    draft_server: str | Callable[[], str | None] | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    draft_deadline_s: float = 0.5  # how long one step waits for its drafts before decoding without them
    drain_timeout_s: float = 30.0  # on stop: how long generations in flight may take to finish
    max_waiting: int = DEFAULT_MAX_WAITING  # requests queued beyond a full batch; then queue_full
    # When the engine cannot go on, exit the process after a second of NOT_SERVING (so a supervisor, Ray or
    # systemd, restarts it); a server embedded in another process only turns NOT_SERVING.
    exit_on_engine_death: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument("port", "must be in [0, 65535]", self.port)
        if not self.draft_deadline_s > 0:
            raise InvalidArgument("draft_deadline_s", "must be > 0", self.draft_deadline_s)
        if self.max_waiting < 0:
            raise InvalidArgument("max_waiting", "must be >= 0", self.max_waiting)
        if self.drain_timeout_s < 0:
            raise InvalidArgument("drain_timeout_s", "must be >= 0", self.drain_timeout_s)
