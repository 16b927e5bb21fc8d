"""What a target worker's draft client counts: rounds, steps without drafts by reason, attaches, and the last
rounds' timings."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

HISTORY = 100_000


@dataclass
class ClientStats:
    rounds: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # reason -> steps without drafts
    attaches: int = 0
    refusals: Counter = field(default_factory=Counter)  # reason -> refused Attach calls
    seeded_tokens: int = 0  # prompt tokens the server took with this worker's KV instead of prefilling them
    unasked_replies: int = 0  # answers to no round in flight (a faulty server's): dropped on arrival
    # The last rounds' timings (bounded: a worker runs for weeks; metrics keep the long view).
    round_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # as seen by the target
    server_queue_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    server_compute_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    def wire_overhead_s(self) -> list[float]:
        return [r - q - c for r, q, c in zip(self.round_s, self.server_queue_s, self.server_compute_s, strict=True)]
