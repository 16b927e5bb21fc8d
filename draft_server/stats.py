"""StarSD's server-side quantities, filled by the compute loop.

  t_s      mean draft forward-pass time
  S        mean service time of a round: from its first pass to its reply
  T_wait   mean time a round waits before its first pass
  T_idle   mean idle gap: time the compute loop waited on an empty queue
           before a batch (waits after the last round are not counted yet)
  load     busy / (busy + idle) since the first round; busy is all the
           loop's time outside those waits (drafting, replies, bookkeeping)
  R_q      rounds per second, all targets; R_p per target
"""

from __future__ import annotations

import threading
import time
from collections import Counter


class ServerStats:
    def __init__(self, observer=None):
        """observer: DraftMetrics, when exported: sees each event as it is recorded."""
        self._lock = threading.Lock()
        self.start_s = time.perf_counter()
        self.first_round_s: float | None = None
        self.rounds = 0
        self.batches = 0
        self.drafted_tokens = 0
        self.passes = 0
        self.pass_s = 0.0
        self.service_s = 0.0  # sum of S over rounds
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.idle_gaps = 0
        self.wait_s = 0.0
        self.rounds_by_worker: Counter[str] = Counter()
        self._attached: Counter[str] = Counter()  # worker id -> its attached sessions: only those are counted
        self.reclaimed_sequences = 0
        self.queue_full = 0  # streams ended because the global queue was full
        self.bad_sequences = 0  # sequences answered resync for breaking a limit (the stream went on)
        self.trees = [0, 0, 0.0]  # candidate trees built: sequence-rounds, nodes, bookkeeping seconds
        self.lookahead = {"lookahead_hits": 0, "lookahead_misses": 0, "lookahead_drafted_tokens": 0,
                          "lookahead_wasted_tokens": 0, "lookahead_prefilled_tokens": 0,
                          "lookahead_branch_hits": 0}
        self.observer = observer

    def record_idle(self, gap_s: float) -> None:
        with self._lock:
            if self.first_round_s is None:
                return
            self.idle_s += gap_s
            self.idle_gaps += 1
        if self.observer is not None:
            self.observer.observe_idle(gap_s)

    def record_trees(self, rounds: int, nodes: int, expand_s: float) -> None:
        with self._lock:
            self.trees = [self.trees[0] + rounds, self.trees[1] + nodes, self.trees[2] + expand_s]

    def record_lookahead(self, engine_stats) -> None:
        """The draft engine's lookahead counters (draft_server.draft_job.DraftStats), as they stand now."""
        e = engine_stats
        with self._lock:
            self.lookahead = {"lookahead_hits": e.lookahead_hits, "lookahead_misses": e.lookahead_misses,
                              "lookahead_drafted_tokens": e.lookahead_drafted,
                              "lookahead_wasted_tokens": e.lookahead_wasted,
                              "lookahead_prefilled_tokens": e.lookahead_prefilled,
                              "lookahead_branch_hits": e.lookahead_branch_hits}

    def record_busy(self, busy_s: float) -> None:
        with self._lock:
            if self.first_round_s is not None:
                self.busy_s += busy_s

    def record_pass(self, rounds: int, sequences: int, passes: int, pass_s: float, drafted: int) -> None:
        """One compute-loop iteration: `passes` forward passes (one per length group) over `sequences`
        sequences of `rounds` rounds in flight."""
        with self._lock:
            if self.first_round_s is None:
                self.first_round_s = time.perf_counter() - pass_s
            self.batches += 1
            self.drafted_tokens += drafted
            self.passes += passes
            self.pass_s += pass_s
        if self.observer is not None:
            self.observer.observe_pass(rounds, sequences, passes, pass_s)

    def record_round(self, wait_s: float, service_s: float, worker: str) -> None:
        """A round answered: it waited wait_s for its first pass and took service_s from there to its reply."""
        with self._lock:
            self.rounds += 1
            self.wait_s += wait_s
            self.service_s += service_s
            if self._attached[worker] > 0:  # a round finishing after its target detached is not kept for it
                self.rounds_by_worker[worker] += 1
        if self.observer is not None:
            self.observer.observe_round(wait_s, service_s)

    def worker_attached(self, worker: str) -> None:
        with self._lock:
            self._attached[worker] += 1

    def forget_worker(self, worker: str) -> None:
        """A detached target's session is gone; with its last one its per-worker figures go (a worker id is the
        caller's choice: unbounded), and rounds of it that finish later are not counted for it again."""
        with self._lock:
            self._attached[worker] -= 1
            if self._attached[worker] <= 0:
                self._attached.pop(worker, None)
                self.rounds_by_worker.pop(worker, None)

    def snapshot(self) -> dict:
        with self._lock:
            now = time.perf_counter()
            span = now - self.first_round_s if self.first_round_s is not None else 0.0
            return {
                "rounds": self.rounds, "batches": self.batches, "drafted_tokens": self.drafted_tokens,
                "draft_steps": self.passes,
                "mean_step_s": self.pass_s / self.passes if self.passes else 0.0,
                "mean_service_s": self.service_s / self.rounds if self.rounds else 0.0,
                "mean_wait_s": self.wait_s / self.rounds if self.rounds else 0.0,
                "mean_idle_s": self.idle_s / self.idle_gaps if self.idle_gaps else 0.0,
                "load": self.busy_s / (self.busy_s + self.idle_s) if self.busy_s + self.idle_s else 0.0,
                "rounds_per_s": self.rounds / span if span else 0.0,
                "per_worker": {w: (n, n / span if span else 0.0) for w, n in self.rounds_by_worker.items()},
                "busy_s": self.busy_s, "idle_s": self.idle_s,
                "uptime_s": now - self.start_s, "reclaimed_sequences": self.reclaimed_sequences,
                "bad_sequences": self.bad_sequences, "queue_full": self.queue_full,
                "tree_rounds": self.trees[0], "tree_nodes": self.trees[1], "tree_expand_s": self.trees[2],
                **self.lookahead,
            }
