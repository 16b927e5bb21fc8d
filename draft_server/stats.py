"""StarSD's server-side quantities, filled by the compute loop.

  t_s      mean draft forward-pass time
  S        mean service time of one batch (all its passes)
  T_wait   mean time a round waits in the queue before its batch starts
  T_idle   mean idle gap of the compute loop between batches
  load     busy time / (busy + idle) since the first round
  R_q      rounds per second, all targets; R_p per target
"""

from __future__ import annotations

import threading
import time
from collections import Counter


class ServerStats:
    def __init__(self):
        self._lock = threading.Lock()
        self.start_s = time.perf_counter()
        self.first_round_s: float | None = None
        self.rounds = 0
        self.batches = 0
        self.drafted_tokens = 0
        self.passes = 0
        self.pass_s = 0.0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.idle_gaps = 0
        self.wait_s = 0.0
        self.rounds_by_worker: Counter[str] = Counter()
        self.reclaimed_sequences = 0
        self.observer = None  # DraftMetrics, when exported: sees each event as it is recorded

    def record_idle(self, gap_s: float) -> None:
        with self._lock:
            if self.first_round_s is None:
                return
            self.idle_s += gap_s
            self.idle_gaps += 1
        if self.observer is not None:
            self.observer.observe_idle(gap_s)

    def record_batch(self, started_s: float, service_s: float, waits: list[float], workers: list[str],
                     drafted: int, passes: int, pass_s: float, sequences: int = 0) -> None:
        with self._lock:
            if self.first_round_s is None:
                self.first_round_s = started_s
            self.batches += 1
            self.rounds += len(waits)
            self.busy_s += service_s
            self.wait_s += sum(waits)
            self.drafted_tokens += drafted
            self.passes += passes
            self.pass_s += pass_s
            self.rounds_by_worker.update(workers)
        if self.observer is not None:
            self.observer.observe_batch(len(waits), sequences, service_s, waits, passes, pass_s)

    def snapshot(self) -> dict:
        with self._lock:
            now = time.perf_counter()
            span = now - self.first_round_s if self.first_round_s is not None else 0.0
            return {
                "rounds": self.rounds, "batches": self.batches, "drafted_tokens": self.drafted_tokens,
                "draft_steps": self.passes,
                "mean_step_s": self.pass_s / self.passes if self.passes else 0.0,
                "mean_service_s": self.busy_s / self.batches if self.batches else 0.0,
                "mean_wait_s": self.wait_s / self.rounds if self.rounds else 0.0,
                "mean_idle_s": self.idle_s / self.idle_gaps if self.idle_gaps else 0.0,
                "load": self.busy_s / (self.busy_s + self.idle_s) if self.busy_s + self.idle_s else 0.0,
                "rounds_per_s": self.rounds / span if span else 0.0,
                "per_worker": {w: (n, n / span if span else 0.0) for w, n in self.rounds_by_worker.items()},
                "uptime_s": now - self.start_s, "reclaimed_sequences": self.reclaimed_sequences,
            }
