"""Draft server settings, validated once at start."""

from __future__ import annotations

from dataclasses import dataclass

from starjar.errors import InvalidArgument

MODES = ("batched", "fifo")


@dataclass(frozen=True)
class DraftServerConfig:
    mode: str = "batched"  # batched: one draft pass for all pending rounds; fifo: one round at a time
    max_targets: int = 8  # N_max: attached targets admitted at once
    max_sequences_per_target: int = 256
    max_tokens_per_sequence: int = 8192
    max_gamma: int = 16
    max_message_bytes: int = 4 << 20
    lease_s: float = 60.0  # unused sequences and stream-less tags are reclaimed after this
    max_batch_rounds: int = 64  # cap on rounds merged into one batch
    # Offload (Nightjar section 6): after this many seconds without a round (every target speculation-free),
    # move the draft weights to host memory and drop all draft KV; the next round reloads in the background.
    offload_after_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument("mode", f"one of {MODES}", self.mode)
        for name, lo, hi in (("max_targets", 0, 4096), ("max_sequences_per_target", 1, 65536),
                             ("max_tokens_per_sequence", 2, 1 << 20), ("max_gamma", 1, 64),
                             ("max_message_bytes", 1024, 1 << 30), ("max_batch_rounds", 1, 4096)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise InvalidArgument(name, f"must be in [{lo}, {hi}]", v)
        if self.offload_after_s is not None and not self.offload_after_s > 0:
            raise InvalidArgument("offload_after_s", "must be > 0 (or unset: never offload)", self.offload_after_s)
        if not self.lease_s > 0:
            raise InvalidArgument("lease_s", "must be > 0", self.lease_s)
