"""The compute half: one thread that drafts whenever the queue has work.

It owns the draft engine (no other thread touches it) and never waits on
I/O: replies go back through a callback that only schedules a write on the
gRPC event loop.

Batched mode schedules per forward pass, not per round: every iteration
takes whatever rounds arrived, starts them, and runs one pass over all
unfinished jobs, so a round that arrives while others are mid-way joins the
next pass (it waits at most one pass, not a whole batch). A round is
answered as soon as its own drafts are done. Fifo mode takes one round and
finishes it before looking at the queue again, as StarSD does.

In both modes a pass feeds every draft step but only a bounded amount of
catch-up (prompts, resyncs), shared fairly between targets
(draft_server.fair_share): one target's huge rounds cannot hold the loop
while another's wait. When no round is in flight, a KV cache left mostly
empty by a burst is shrunk and the memory given back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from draft_server import fair_share
from draft_server.config import DraftServerConfig
from draft_server.engine import MAX_FEED, DraftEngine, DraftJob
from draft_server.fanout import BRANCHES
from draft_server.faults import FaultPlan, Faults
from draft_server.stats import ServerStats
from draft_server.work_queue import ReleaseWork, RoundWork, WorkQueue
from starjar.cpu.kernels import adopt_thread_count
from starjar.model import allocator

log = logging.getLogger(__name__)
# Lookahead waits while the loop's recent busy share (per wake-up, an EMA) is above this: a saturated server's rounds
# would wait on its passes (bench star, replay targets, N = 8 batched: 0.945x with lookahead drafting in the gaps).
LOOKAHEAD_MAX_LOAD = 0.85
LOAD_EMA = 0.3
LOOKAHEAD_BATCH = 8  # sequences one lookahead pass drafts for at most: the pass a real round may wait on stays short


@dataclass(eq=False)
class _Active:
    work: RoundWork
    replies: list
    jobs: list[tuple[int, DraftJob]]
    started_s: float

    @property
    def done(self) -> bool:
        return all(j.done for _, j in self.jobs)


class ComputeLoop(threading.Thread):
    def __init__(self, engine: DraftEngine, queue: WorkQueue, stats: ServerStats, mode: str = "batched",
                 max_batch_rounds: int = DraftServerConfig.max_batch_rounds, faults: Faults | None = None, tide=None,
                 pass_catchup_tokens: int = MAX_FEED, lookahead: str = "off"):
        """mode, max_batch_rounds and pass_catchup_tokens: DraftServerConfig's. batched: rounds join the passes in
        flight (continuous batching, at most max_batch_rounds at once); fifo: one round at a time.
        tide: draft_server.tide.adaptation.Tide (online adaptation: sees each answered round, trains when idle).
        lookahead: "chain" drafts ahead for each answered round's full acceptance while no round waits
        (draft_server.lookahead), "fanout" also for its likeliest rejections (draft_server.fanout); "off" does
        not."""
        super().__init__(name="draft-compute", daemon=True)
        self.engine = engine
        self.queue = queue
        self.stats = stats
        self.continuous = mode == "batched"
        self.max_batch_rounds = max_batch_rounds
        self.faults = faults or Faults(FaultPlan())
        self.tide = tide
        self.pass_catchup_tokens = pass_catchup_tokens
        self.lookahead = lookahead != "off"
        self.engine.ahead.branches = BRANCHES if lookahead == "fanout" else 0
        self.recent_load = 0.0  # busy / (busy + idle) since each wake-up by a round, as an EMA
        self._busy_since_wake = 0.0
        self.engine.prefill_ahead = self.lookahead
        # The engine is this thread's; the offload check (from the server's sweeper) takes this lock too.
        self.lock = threading.Lock()
        self.last_round_s = time.perf_counter()
        self._active: list[_Active] = []
        self._held: list[RoundWork] = []  # rounds whose sequence still has a job in flight
        self._releases: list[ReleaseWork] = []  # releases waiting for in-flight jobs of their sequences
        self._cache_bytes = 0  # the KV cache's size when memory was last given back

    def run(self) -> None:
        adopt_thread_count()  # this thread computes: torch's thread count, not the environment's
        # StarSD's idle time is time with no round to serve: only the waits on an empty queue count.
        # Everything else the loop does (drafting, replies, bookkeeping) is busy time.
        idle = 0.0
        while True:
            busy = bool(self._active or self._held)
            ahead = self._lookahead_jobs() if not busy else []
            tide = self.tide if not busy and not ahead and not self.engine.offloaded else None
            train = tide is not None and tide.wants_idle()
            waited = 0.0
            if busy and not self.continuous:
                items = []
            else:
                room = self.max_batch_rounds - len(self._active) if self.continuous else 1
                items = self.queue.take(block=not busy and not train and not ahead, max_rounds=max(0, room))
                waited = self.queue.last_wait_s
            if items is None:
                return
            if ahead and not items:  # no round waits: one lookahead pass, counted as idle time (none waited)
                idle += self._look_ahead(ahead)
                continue
            if train and not items:  # no round to serve: one training micro-step instead of waiting
                idle += self._idle_train(tide)
                continue
            got = time.perf_counter()
            idle += waited
            if any(isinstance(w, RoundWork) for w in items):  # a wake-up that only frees sequences: still idle
                self.stats.record_idle(idle)
                self._note_wake(idle)
                idle = 0.0
            try:
                with self.lock:
                    self._iterate(items)
                    self.stats.record_lookahead(self.engine.stats)
                    if not self._active and not self._held:  # between rounds, so no pass in flight grows it right back
                        self.engine.shrink_cache()
                    self._give_back_outgrown_cache()
            except Exception:  # a bug here must not kill drafting for everyone
                log.exception("draft pass failed; its rounds get resync answers")
                self._fail_all()
            self.stats.record_busy(busy := time.perf_counter() - got)
            self._busy_since_wake += busy

    def _note_wake(self, idle_s: float) -> None:
        """A round woke the loop after idle_s idle: the busy share since the last wake-up joins recent_load."""
        total = self._busy_since_wake + idle_s
        if total > 0:
            self.recent_load = (1 - LOAD_EMA) * self.recent_load + LOAD_EMA * self._busy_since_wake / total
        self._busy_since_wake = 0.0

    def _give_back_outgrown_cache(self) -> None:
        """The KV cache changed size (grew, shrank, or was dropped by an offload): the copies it left are free
        heap memory (starjar.model.allocator keeps a pass's scratch in the heap), returned to the OS now."""
        size = self.engine.cache.nbytes()
        if size != self._cache_bytes:
            self._cache_bytes = size
            allocator.give_back_free()

    def _iterate(self, items) -> None:
        now = time.perf_counter()
        self._held += [w for w in items if isinstance(w, RoundWork)]
        self._releases += [w for w in items if isinstance(w, ReleaseWork)]
        in_flight = {j.seq_id for a in self._active for _, j in a.jobs if not j.done}
        held, starting = [], []
        for w in self._held:
            keys = {r.seq_id for r in w.requests}
            # A target that gave up on a round (deadline) may send the next one for the same sequence
            # before the first is done: it waits, one job per sequence at a time.
            if keys & in_flight or (not self.continuous and starting):
                held.append(w)
            else:
                starting.append(w)
                in_flight |= keys
        self._held = held
        for w in starting:
            self.last_round_s = now
            try:
                catchup0 = self.engine.stats.catchup_tokens
                replies, jobs = self.engine.start(w.requests)
                self.faults.after_start(self.engine.stats.catchup_tokens - catchup0)
            except Exception:  # this round only: its sequences are dropped and it is answered resync
                log.exception("a round could not start; it gets resync answers")
                self._answer_resync(w)
                continue
            self._active.append(_Active(w, replies, jobs, now))
        if self._active:
            self._pass()
        self._apply_releases()

    def _pass(self) -> None:
        es = self.engine.stats
        passes0, pass_s0, drafted0 = es.passes, es.catchup_s + es.step_s, es.drafted_tokens
        trees0 = (es.tree_jobs, es.tree_nodes, es.tree_expand_s)
        jobs = fair_share.plan([(a.work.tag, [j for _, j in a.jobs if not j.done]) for a in self._active],
                               self._catchup_budget())
        if jobs:
            self.engine.advance(jobs)
            self.faults.after_pass()
        self.stats.record_pass(len(self._active), len(jobs), es.passes - passes0,
                               es.catchup_s + es.step_s - pass_s0, es.drafted_tokens - drafted0)
        if es.tree_jobs != trees0[0]:
            self.stats.record_trees(es.tree_jobs - trees0[0], es.tree_nodes - trees0[1],
                                    es.tree_expand_s - trees0[2])
        finished = [a for a in self._active if a.done]
        self._active = [a for a in self._active if not a.done]
        now = time.perf_counter()
        if self.lookahead and finished:  # the hits and misses these rounds counted, current before their replies
            self.stats.record_lookahead(self.engine.stats)
        for a in finished:
            for i, job in a.jobs:
                a.replies[i] = job.reply()
            wait, service = a.started_s - a.work.enqueued_s, now - a.started_s
            self.stats.record_round(wait, service, a.work.worker_id)
            replies = self.faults.before_reply(a.replies)
            a.work.reply(a.work, replies, wait, service, len(finished) + len(self._active))
        if self.lookahead:  # the answered chains' likeliest next rounds, drafted while the targets verify
            for a in finished:
                for _, job in a.jobs:
                    self.engine.stage(job, _pusher(a.work))
        if self.tide is not None and finished:  # after every reply: learning stays off the rounds' path
            self._observe(self.tide, finished)

    def _catchup_budget(self) -> int:
        """Catch-up tokens for the next pass: a whole pass while one target has rounds in flight and nothing
        waits (nobody to be fair to: its prompts go at full speed); pass_catchup_tokens, shared, otherwise."""
        owners = {a.work.tag for a in self._active} | {w.tag for w in self._held}
        if len(owners) <= 1 and not len(self.queue):
            return max(self.pass_catchup_tokens, self.engine.max_pass_tokens)
        return self.pass_catchup_tokens

    def _observe(self, tide, finished) -> None:
        """Show the adaptation the finished rounds. A failing observer is switched off, as a failing trainer
        is: it must never cost a round its reply or the server its drafting."""
        try:
            for a in finished:
                tide.observe_round(a.work.requests, a.replies, a.work.train)
        except Exception:
            log.exception("draft adaptation failed; it is off until restart (drafting goes on)")
            self.tide = None

    def _lookahead_jobs(self) -> list:
        if not self.lookahead or self.engine.offloaded or self.recent_load > LOOKAHEAD_MAX_LOAD:
            return []
        return self.engine.ahead.jobs()[:LOOKAHEAD_BATCH]

    def _look_ahead(self, jobs) -> float:
        """One lookahead pass; its seconds. A failure drops the sequences worked ahead for (their next rounds
        resync)."""
        t0 = time.perf_counter()
        with self.lock:
            try:
                self.engine.advance_lookahead(jobs)
                self.engine.ahead.push_done()
            except Exception:
                log.exception("a lookahead pass failed; its sequences are dropped (their next rounds resync)")
                self.engine.release(self.engine.ahead.sequences())
            self.stats.record_lookahead(self.engine.stats)
        return time.perf_counter() - t0

    def _idle_train(self, tide) -> float:
        """One training micro-step (the queue was empty); its seconds count as idle time: no round waited.
        A failing trainer is switched off, never the drafting."""
        try:
            with self.lock:
                return tide.idle_step()
        except Exception:
            log.exception("draft adaptation failed; it is off until restart (drafting goes on)")
            self.tide = None
            return 0.0

    def _apply_releases(self) -> None:
        # Releases go after the rounds taken with them (a stream that ends with a round in flight must not
        # see that round recreate the sequence), and wait while a job of the sequence is unfinished.
        busy = {j.seq_id for a in self._active for _, j in a.jobs} | {
            r.seq_id for w in self._held for r in w.requests}
        waiting = []
        for w in self._releases:
            if busy.intersection(w.keys):
                waiting.append(w)
                continue
            before = self.engine.num_sequences
            self.engine.release(w.keys)
            if self.tide is not None:
                self.tide.release(w.keys)
            if w.done:
                w.done(before - self.engine.num_sequences)
        self._releases = waiting

    def _fail_all(self) -> None:
        """After a failed pass the cache of the rounds in flight is suspect: drop those sequences (their next
        rounds resync) and answer every round in flight or held with resync."""
        rounds = [a.work for a in self._active] + self._held
        self._active, self._held = [], []
        for w in rounds:
            self._answer_resync(w)
        try:
            self._apply_releases()
        except Exception:
            log.exception("could not apply releases after a failed pass")
            self._releases = []

    def _answer_resync(self, w: RoundWork) -> None:
        try:
            self.engine.release([r.seq_id for r in w.requests])
        except Exception:
            log.exception("could not drop the sequences of a failed round")
        w.reply(w, [None] * len(w.requests), 0.0, 0.0, 0)

    def offload_if_idle(self, idle_s: float) -> bool:
        """Offload the draft when no round came for idle_s seconds (called off this thread)."""
        with self.lock:
            if (self.engine.offloaded or self._active or self._held
                    or time.perf_counter() - self.last_round_s < idle_s):
                return False
            self.engine.offload()
            self._give_back_outgrown_cache()
            log.info("no rounds for %.0f s: draft offloaded, its KV dropped", idle_s)
            return True


def _pusher(work: RoundWork):
    """How a complete stage of this round's sequences reaches its target: pushed on the round's stream."""
    if work.push is None:
        return None
    return lambda st, assumed, drafts: work.push(st.job.seq_id[1], st.base, assumed, drafts)
