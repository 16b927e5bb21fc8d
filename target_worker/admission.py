"""How many requests a target worker holds at once: a full batch running plus a bounded waiting queue.

Past the bound a new request is refused at once (RESOURCE_EXHAUSTED, reason
queue_full) rather than queued without end, so a router can try another
worker and a client can back off. The count lives on the server's event loop,
where every Generate call starts and ends, so it needs no lock.
"""

from __future__ import annotations

from starjar.errors import InvalidArgument
from starjar.wire.keys import QUEUE_FULL

DEFAULT_MAX_WAITING = 256  # requests queued beyond the running batch


class AdmissionQueue:
    def __init__(self, max_running: int, max_waiting: int = DEFAULT_MAX_WAITING):
        if max_waiting < 0:
            raise InvalidArgument("--max-waiting", "must be >= 0", max_waiting)
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.held = 0  # admitted and not finished: tokenizing, waiting or running
        self.refused = 0

    @property
    def limit(self) -> int:
        return self.max_running + self.max_waiting

    def try_enter(self) -> bool:
        if self.held >= self.limit:
            self.refused += 1
            return False
        self.held += 1
        return True

    def leave(self) -> None:
        self.held -= 1

    def collect(self):
        """Prometheus collector protocol: the server registers the queue itself."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("starjar_target_admission_held", "requests held (running, waiting or being "
                                "tokenized)", value=self.held)
        yield GaugeMetricFamily("starjar_target_admission_limit", "requests held at most (batch + --max-waiting)",
                                value=self.limit)
        refused = CounterMetricFamily("starjar_target_requests_refused", "requests refused, by reason",
                                      labels=["reason"])
        refused.add_metric([QUEUE_FULL], self.refused)
        yield refused

    def refusal(self) -> str:
        """The human half of a refusal: what is full and which limits make it so."""
        return (f"target worker full: {self.held} requests running or waiting, its limit "
                f"(batch size {self.max_running} + --max-waiting {self.max_waiting}); retry later or elsewhere")
