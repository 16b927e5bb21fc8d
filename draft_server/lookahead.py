"""Lookahead, chain mode: drafting a sequence's likeliest next round while its target verifies this one.

After a round is answered with drafts d1..dg, the likeliest outcome is full acceptance followed by the
target's bonus token, guessed as the draft's own argmax after dg. A Stage drafts for that outcome in the
compute loop's idle time, one one-token pass at a time: one job fed [dg] that drafts g + 1 tokens, the guess
b first and then the next round's drafts d1'..dg'. Nothing is fed twice: the guess's pass already leaves
dg's KV where a real round would write it.

A stage is keyed by its sequence, the verified length it assumes (`base`) and the tokens it assumes come
next (`assumed` = d1..dg b). The next real round of the sequence ends it: when the round's verified tokens are
exactly verified[:base] + assumed, the round takes the stage's job over (a hit: its drafts so far are kept, and
a complete job answers without a draft pass); otherwise the KV goes back to what the round left (a miss), so
the draft reads what a server without lookahead would.

A target may also send a new sequence's prompt before it prefills it itself (a round with gamma 0); the draft
then feeds that prompt in idle time (an ingest job, PREFILL_CHUNK tokens a pass so that a real round waits on
little), and the sequence's first real round finds its KV in place.

When a stage is complete the server pushes its drafts on the sequence's stream, keyed by the verified length
and tokens they assume (target_worker.remote.staged): a target whose round turns out to be exactly that one
uses them without waiting for the reply.

A hit's drafts come from one-token passes where a server without lookahead feeds [dg, b] in one pass; they
may differ in the last bits of the logits, so rarely in a token. What a request outputs never depends on its
drafts (verification decides; seeded draws depend on the position alone, starjar.spec.sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from draft_server.draft_job import DraftJob, DraftSeq, DraftStats
from draft_server.kv_pool import DraftKVCache
from starjar.spec.proposer import DraftRequest

MODES = ("off", "chain")
PREFILL_CHUNK = 64  # prompt tokens an ingest pass feeds at most: a real round arriving meanwhile waits on little


@dataclass(eq=False)
class Stage:
    seq: DraftSeq
    base: int  # len(seq.verified) when the round was answered
    base_cached: int  # len(seq.cached) then: the KV a server without lookahead holds
    sent: list[int]  # the drafts that round answered (d1..dg)
    job: DraftJob  # fed [dg]: its first draft is the guess, the rest the next round's
    push: Callable[[Stage], None] | None = None  # told once when the job is done (the drafts go to the target)

    @classmethod
    def after(cls, job: DraftJob) -> Stage:
        """The stage for a finished chain job (its drafts were just answered)."""
        seq, g = job.seq, len(job.drafts)
        ahead = DraftJob(job.seq_id, seq, g + 1, [job.drafts[-1]], passes=1)  # passes: steps, not a catch-up
        return cls(seq, len(seq.verified), len(seq.cached), list(job.drafts), ahead)

    @property
    def guess(self) -> int | None:
        return self.job.drafts[0] if self.job.drafts else None

    @property
    def drafted(self) -> int:
        """Tokens this stage has drafted: the guess and the next round's drafts."""
        return len(self.job.drafts)

    def matches(self, req: DraftRequest) -> bool:
        """Whether the round (not yet applied) makes the verified tokens exactly verified[:base] + assumed."""
        if self.guess is None or req.tree_width > 1 or req.start > self.base:
            return False
        assumed = self.sent + [self.guess]
        tokens = [int(t) for t in req.tokens]
        cut = self.base - req.start
        return (req.start + len(tokens) == self.base + len(assumed)
                and tokens[:cut] == self.seq.verified[req.start:self.base] and tokens[cut:] == assumed)

    def take(self, gamma: int, cache: DraftKVCache) -> DraftJob:
        """A hit (the round already applied): the stage's drafts past the guess become the round's own job,
        asking gamma drafts. One that has them already is done (no draft pass), its KV cut to what a real
        round would leave: the verified tokens and the first gamma - 1 drafts."""
        ahead = self.job
        job = DraftJob(ahead.seq_id, self.seq, gamma, list(ahead.feed), drafts=ahead.drafts[1:],
                       passes=ahead.passes)
        if len(job.drafts) >= gamma:
            keep = len(self.seq.read) + gamma - 1
            cache.truncate(self.seq.slot, keep)
            del self.seq.cached[keep:]
            del job.drafts[gamma:]
            job.feed = [job.drafts[-1]]
        return job

    def undo(self, cache: DraftKVCache) -> None:
        """The KV back to what the answered round left."""
        if len(self.seq.cached) > self.base_cached:
            cache.truncate(self.seq.slot, self.base_cached)
            del self.seq.cached[self.base_cached:]


class Lookahead:
    """A draft engine's work ahead: at most one stage or ingest job per sequence."""

    def __init__(self, stats: DraftStats):
        self.stats = stats
        self.stages: dict[Hashable, Stage] = {}
        self.ingests: dict[Hashable, DraftJob] = {}

    def clear(self) -> None:
        self.stages.clear()
        self.ingests.clear()

    def drop(self, seq_id: Hashable) -> None:
        self.stages.pop(seq_id, None)
        self.ingests.pop(seq_id, None)

    def sequences(self) -> list[Hashable]:
        return list(self.stages) + list(self.ingests)

    def jobs(self) -> list[DraftJob]:
        """The unfinished jobs ahead, oldest first: prompts to ingest, then stages."""
        return [j for j in self.ingests.values() if not j.done] + [s.job for s in self.stages.values()
                                                                   if not s.job.done]

    def stage(self, job: DraftJob, push: Callable[[Stage], None] | None = None) -> None:
        self.stages[job.seq_id] = stage = Stage.after(job)
        stage.push = push

    def push_done(self) -> None:
        """Tell each stage whose drafts are complete, once (a push sends them to the target)."""
        for stage in self.stages.values():
            if stage.push is not None and stage.job.done:
                push, stage.push = stage.push, None
                push(stage)

    def ingest(self, req: DraftRequest, seq: DraftSeq) -> None:
        """A round that only records tokens (gamma 0): feed the ones the KV lacks, ahead of the next round."""
        read = seq.read
        if len(read) <= len(seq.cached) or seq.cached != read[:len(seq.cached)]:
            return
        job = DraftJob(req.seq_id, seq, 1, read[len(seq.cached):], allow=PREFILL_CHUNK)  # its one draft is unused
        self.ingests[req.seq_id] = job

    def claim(self, req: DraftRequest, cache: DraftKVCache) -> Stage | None:
        """A real round for the sequence ends what was ahead of it: a stage is returned when the round matches
        what it assumed; otherwise its KV goes back to what the answered round left (a miss) and None. An
        ingest's KV is the verified prompt's: it stays for the round's catch-up."""
        self.ingests.pop(req.seq_id, None)
        stage = self.stages.pop(req.seq_id, None)
        if stage is None or stage.matches(req):
            return stage
        stage.undo(cache)
        if stage.drafted:  # a stage no pass reached (rounds kept coming) is no miss: nothing was drafted ahead
            self.stats.lookahead_misses += 1
            self.stats.lookahead_wasted += stage.drafted
        return None

    def take(self, stage: Stage, gamma: int, cache: DraftKVCache) -> DraftJob | None:
        """A claimed stage's job for a round asking gamma drafts (None when it asks none)."""
        if gamma <= 0:  # nothing asked: the KV goes back all the same
            stage.undo(cache)
            self.stats.lookahead_misses += 1
            self.stats.lookahead_wasted += stage.drafted
            return None
        ready = len(stage.job.drafts) - 1  # past the guess
        self.stats.lookahead_hits += 1
        self.stats.lookahead_wasted += max(0, ready - gamma)
        return stage.take(gamma, cache)
