"""Draft server settings, validated once at start."""

from __future__ import annotations

from dataclasses import dataclass

from draft_server.lookahead import MODES as LOOKAHEAD_MODES
from draft_server.tide.config import TideConfig
from starjar.errors import InvalidArgument

MODES = ("batched", "fifo")
MAX_INTERVAL_S = 7 * 86400  # a week: keepalive and idle intervals in ms fit gRPC's int32


@dataclass(frozen=True)
class DraftServerConfig:
    host: str = "127.0.0.1"  # where the gRPC server listens
    port: int = 0  # 0 = any free port
    mode: str = "batched"  # batched: one draft pass for all pending rounds; fifo: one round at a time
    max_targets: int = 8  # N_max: attached targets admitted at once
    # Sessions one caller may hold (refused with reason "caller" past it); None: only N_max bounds them. The
    # caller is the client certificate's subject and the peer's host: without mutual TLS, every target of a
    # one-host cluster is the same caller, so set it to the most targets one host (or certificate) runs.
    max_targets_per_caller: int | None = None
    # An Attach under the worker id of an attached session replaces it (a restarted target gets its slot back)
    # once that session is this old, and, from another caller, once it has had no round for this long. Until
    # then the Attach is refused (reason "worker_id"): two processes under one id do not evict each other as
    # fast as they can attach, and another caller never displaces a live target.
    reclaim_after_s: float = 2.0
    max_sequences_per_target: int = 256
    max_tokens_per_sequence: int = 8192
    max_gamma: int = 16
    max_tree_width: int = 4  # widest beam-search tree a round may ask for (1: chains only)
    max_tree_nodes: int = 64  # most nodes in one sequence's tree (a wider request is narrowed to fit)
    max_message_bytes: int = 4 << 20
    lease_s: float = 60.0  # unused sequences and stream-less tags are reclaimed after this
    max_batch_rounds: int = 64  # cap on rounds merged into one batch
    # Catch-up tokens (prompts, resyncs) one draft pass feeds, shared fairly between targets: how long one
    # target's prompts may keep another's rounds waiting (draft_server.fair_share). Draft steps always ride.
    pass_catchup_tokens: int = 512
    # Offload (Nightjar section 6): after this many seconds without a round (every target speculation-free),
    # move the draft weights to host memory and drop all draft KV; the next round reloads in the background.
    offload_after_s: float | None = None
    # Memory: the draft KV cache in tokens (live sequences x the longest; None = a quarter of this machine's
    # memory, or the GPU's), and what one target may hold (None = twice its fair share of N_max).
    max_kv_tokens: int | None = None
    max_kv_tokens_per_target: int | None = None
    max_rounds_in_flight: int = 2  # per stream: the reader stops reading past this (flow control)
    max_queued_rounds: int = 1024  # the global queue; past it a stream is ended RESOURCE_EXHAUSTED
    # Dead peers: HTTP/2 pings every keepalive_s, unanswered within keepalive_timeout_s close the connection
    # (and the session with it); a stream with no round for stream_idle_s is ended (the target reattaches).
    keepalive_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    stream_idle_s: float = 600.0
    # Online draft adaptation (TIDE): None = off. On, the draft learns a logit adapter from the targets'
    # verified tokens in the compute loop's idle time (draft_server/tide/adaptation.py).
    tide: TideConfig | None = None
    # Lookahead (draft_server.lookahead): "chain" drafts each answered round's likeliest next round (all drafts
    # accepted, the bonus token guessed) while no round waits; "fanout" also its likeliest rejections
    # (draft_server.fanout); "off" leaves the idle time idle.
    lookahead: str = "off"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument("port", "must be in [0, 65535]", self.port)
        if self.mode not in MODES:
            raise InvalidArgument("mode", f"one of {MODES}", self.mode)
        if self.lookahead not in LOOKAHEAD_MODES:
            raise InvalidArgument("lookahead", f"one of {LOOKAHEAD_MODES}", self.lookahead)
        # A fanout hit moves a branch's KV into place with no pass: TIDE's tap would keep stale hidden states there.
        if self.lookahead == "fanout" and self.tide is not None:
            raise InvalidArgument("lookahead", "fanout cannot run with online adaptation (--adapt)", self.lookahead)
        for name, lo, hi in (("max_targets", 0, 4096), ("max_sequences_per_target", 1, 65536),
                             ("max_tokens_per_sequence", 2, 1 << 20), ("max_gamma", 1, 64), ("max_tree_width", 1, 16),
                             ("max_tree_nodes", 1, 256),
                             ("max_message_bytes", 1024, 1 << 30), ("max_batch_rounds", 1, 4096),
                             ("pass_catchup_tokens", 16, 1 << 20)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise InvalidArgument(name, f"must be in [{lo}, {hi}]", v)
        if self.max_targets_per_caller is not None and not 1 <= self.max_targets_per_caller <= 4096:
            raise InvalidArgument("max_targets_per_caller", "must be in [1, 4096] (or unset: no cap)",
                                  self.max_targets_per_caller)
        if self.offload_after_s is not None and not self.offload_after_s > 0:
            raise InvalidArgument("offload_after_s", "must be > 0 (or unset: never offload)", self.offload_after_s)
        for name in ("max_kv_tokens", "max_kv_tokens_per_target"):
            v = getattr(self, name)
            if v is not None and not 16 <= v <= 1 << 40:
                raise InvalidArgument(name, "must be in [16, 2^40] (or unset: sized from memory)", v)
        for name, lo, hi in (("max_rounds_in_flight", 1, 64), ("max_queued_rounds", 1, 1 << 20)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise InvalidArgument(name, f"must be in [{lo}, {hi}]", v)
        for name in ("keepalive_s", "keepalive_timeout_s", "stream_idle_s"):  # gRPC takes them as int32 ms
            if not 0 < getattr(self, name) <= MAX_INTERVAL_S:
                raise InvalidArgument(name, f"must be in (0, {MAX_INTERVAL_S}] seconds", getattr(self, name))
        if not 0 <= self.reclaim_after_s <= MAX_INTERVAL_S:
            raise InvalidArgument("reclaim_after_s", f"must be in [0, {MAX_INTERVAL_S}] seconds", self.reclaim_after_s)
        if not self.lease_s > 0:
            raise InvalidArgument("lease_s", "must be > 0", self.lease_s)
