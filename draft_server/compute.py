"""The compute half: one thread that drafts whenever the queue has work.

It owns the draft engine (no other thread touches it) and never waits on
I/O: replies go back through a callback that only schedules a write on the
gRPC event loop.
"""

from __future__ import annotations

import logging
import threading
import time

from draft_server.engine import DraftEngine
from draft_server.stats import ServerStats
from draft_server.work_queue import ReleaseWork, RoundWork, WorkQueue

log = logging.getLogger(__name__)


class ComputeLoop(threading.Thread):
    def __init__(self, engine: DraftEngine, queue: WorkQueue, stats: ServerStats):
        super().__init__(name="draft-compute", daemon=True)
        self.engine = engine
        self.queue = queue
        self.stats = stats
        # The engine is this thread's; the offload check (from the server's sweeper) takes this lock too.
        self.lock = threading.Lock()
        self.last_round_s = time.perf_counter()

    def run(self) -> None:
        idle_from = time.perf_counter()
        while True:
            items = self.queue.take()
            if items is None:
                return
            # T_idle is the wait for rounds: a wake-up that only frees sequences does not end it.
            has_rounds = any(isinstance(w, RoundWork) for w in items)
            if has_rounds:
                self.stats.record_idle(time.perf_counter() - idle_from)
            try:
                with self.lock:
                    self._serve(items)
            except Exception:  # a bug here must not kill drafting for everyone
                log.exception("draft batch failed; its rounds get resync answers")
                for w in items:
                    if isinstance(w, RoundWork):
                        w.reply(w, [None] * len(w.requests), 0.0, 0.0, 0)
            if has_rounds:
                idle_from = time.perf_counter()

    def _serve(self, items) -> None:
        rounds = [w for w in items if isinstance(w, RoundWork)]
        try:
            if rounds:
                self._draft(rounds)
        finally:
            # Releases go last: a release queued after a round of the same sequence (a stream
            # that ends with a round in flight) must not be undone by that round recreating it.
            for w in items:
                if isinstance(w, ReleaseWork):
                    before = self.engine.num_sequences
                    self.engine.release(w.keys)
                    if w.done:
                        w.done(before - self.engine.num_sequences)

    def offload_if_idle(self, idle_s: float) -> bool:
        """Offload the draft when no round came for idle_s seconds (called off this thread)."""
        with self.lock:
            if self.engine.offloaded or time.perf_counter() - self.last_round_s < idle_s:
                return False
            self.engine.offload()
            log.info("no rounds for %.0f s: draft offloaded, its KV dropped", idle_s)
            return True

    def _draft(self, rounds: list[RoundWork]) -> None:
        start = time.perf_counter()
        self.last_round_s = start
        flat = [r for w in rounds for r in w.requests]
        es = self.engine.stats
        passes0, pass_s0, drafted0 = es.passes, es.catchup_s + es.step_s, es.drafted_tokens
        replies = self.engine.propose(flat)
        service = time.perf_counter() - start
        passes = es.passes - passes0
        self.stats.record_batch(start, service, [start - w.enqueued_s for w in rounds],
                                [w.worker_id for w in rounds], es.drafted_tokens - drafted0, passes,
                                es.catchup_s + es.step_s - pass_s0, sequences=len(flat))
        i = 0
        for w in rounds:
            n = len(w.requests)
            w.reply(w, replies[i:i + n], start - w.enqueued_s, service, len(rounds))
            i += n
