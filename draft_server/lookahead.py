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
little), and the sequence's first real round finds its KV in place. The ingest's one draft guesses the
target's first token, so a stage then drafts that first round as it would any other.

When a stage is complete the server pushes its drafts on the sequence's stream, keyed by the verified length
and tokens they assume (target_worker.remote.staged): a target whose round turns out to be exactly that one
uses them without waiting for the reply.

With `--lookahead fanout` a stage whose chain is complete also drafts for the round's likeliest rejections,
one branch each (draft_server.fanout), pushed the same way.

A hit's drafts come from one-token passes where a server without lookahead feeds [dg, b] in one pass; they
may differ in the last bits of the logits, so rarely in a token. What a request outputs never depends on its
drafts (verification decides; seeded draws depend on the position alone, starjar.spec.sampling).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from draft_server.draft_job import DraftJob, DraftSeq, DraftStats
from draft_server.fanout import Branch, BranchClock, cut_to, likeliest_rejections
from draft_server.kv_pool import DraftKVCache
from starjar.spec.proposer import DraftRequest

MODES = ("off", "chain", "fanout")
PREFILL_CHUNK = 64  # prompt tokens an ingest pass feeds at most: a real round arriving meanwhile waits on little
FIRST_GAMMA = 3  # a first round's drafts staged before any real round said how many it asks


@dataclass(eq=False)
class Stage:
    seq: DraftSeq
    base: int  # len(seq.verified) when the round was answered
    base_cached: int  # len(seq.cached) then: the KV a server without lookahead holds
    sent: list[int]  # the drafts that round answered (d1..dg)
    job: DraftJob  # fed [dg]: its first draft is the guess, the rest the next round's
    push: Callable[[Stage, list[int], list[int]], None] | None = None  # (stage, assumed, drafts): to the target
    branches: list[Branch] = field(default_factory=list)  # fanout: the likeliest rejections, likeliest first
    hit: Branch | None = None  # the branch a claimed round turned out to be
    pushed: bool = False
    answered_s: float = field(default_factory=time.perf_counter)  # when the round was answered

    @classmethod
    def after(cls, job: DraftJob, cache: DraftKVCache, branches: int = 0) -> Stage:
        """The stage for a finished chain job (its drafts were just answered), with up to `branches`
        branches when the job's draft probabilities are known."""
        seq, g = job.seq, len(job.drafts)
        ahead = DraftJob(job.seq_id, seq, g + 1, [job.drafts[-1]], passes=1)  # passes: steps, not a catch-up
        stage = cls(seq, len(seq.verified), len(seq.cached), list(job.drafts), ahead)
        if branches and len(job.tops) == g:
            read = stage.base_cached - (g - 1)  # the verified tokens the KV holds: the drafts' positions follow
            for likelihood, point, token in likeliest_rejections(job.tops, branches):
                b = DraftJob(job.seq_id, seq, g, [token], passes=1)
                b.branch = Branch(point, token, likelihood, read + point - 1, b, cache)
                stage.branches.append(b.branch)
        return stage

    @classmethod
    def after_ingest(cls, job: DraftJob, gamma: int) -> Stage:
        """The stage for an ingest that fed its whole prompt: nothing was answered yet, and the ingest's one draft
        guesses the target's first token, so the stage assumes just [guess] and drafts the first round past it."""
        seq, guess = job.seq, job.drafts[-1]
        ahead = DraftJob(job.seq_id, seq, gamma + 1, [guess], drafts=[guess], passes=1, tops=job.tops[-1:])
        return cls(seq, len(seq.verified), len(seq.cached), [], ahead)

    @property
    def guess(self) -> int | None:
        return self.job.drafts[0] if self.job.drafts else None

    @property
    def extent(self) -> int:
        """The most KV tokens this stage's row can come to hold: the verified tokens, the answered drafts, the
        guess and the next round's drafts (the job's), and a row of g + 1 per branch past them."""
        g = len(self.sent)
        return self.base + g + self.job.gamma + len(self.branches) * (g + 1)

    @property
    def drafted(self) -> int:
        """Tokens this stage has drafted: the guess and the next round's drafts, and its branches'."""
        return len(self.job.drafts) + sum(len(b.job.drafts) for b in self.branches)

    def next_job(self) -> DraftJob | None:
        """What to draft next for this stage: the chain, then each branch in turn."""
        if not self.job.done:
            return self.job
        return next((b.job for b in self.branches if not b.job.done), None)

    def matches(self, req: DraftRequest) -> bool:
        """Whether the round (not yet applied) makes the verified tokens exactly verified[:base] + assumed,
        assumed being the chain's or a drafted branch's (then remembered in `hit`)."""
        if req.tree_width > 1 or req.start > self.base:
            return False
        tokens = [int(t) for t in req.tokens]
        cut = self.base - req.start
        if tokens[:cut] != self.seq.verified[req.start:self.base]:
            return False
        if self.guess is not None and tokens[cut:] == self.sent + [self.guess]:
            return True
        self.hit = next((b for b in self.branches if b.job.drafts and tokens[cut:] == b.assumed(self.sent)), None)
        return self.hit is not None

    def take(self, gamma: int, cache: DraftKVCache) -> DraftJob:
        """A hit (the round already applied): the stage's drafts past the guess, or the branch's, become the
        round's own job, asking gamma drafts. One that has them already is done (no draft pass)."""
        if self.hit is not None:
            return self.hit.take(gamma)
        ahead = self.job
        if cache.lengths[self.seq.slot] > len(self.seq.cached):  # branches' KV past the chain's
            cache.truncate(self.seq.slot, len(self.seq.cached))
        job = DraftJob(ahead.seq_id, self.seq, gamma, list(ahead.feed), drafts=ahead.drafts[1:],
                       passes=ahead.passes, tops=ahead.tops[1:])
        return cut_to(job, gamma, cache)

    def undo(self, cache: DraftKVCache) -> None:
        """The KV back to what the answered round left."""
        if cache.lengths[self.seq.slot] > self.base_cached:
            cache.truncate(self.seq.slot, self.base_cached)
        del self.seq.cached[self.base_cached:]

    def push_done(self) -> None:
        """Send what is complete and not yet sent: the chain's drafts, each branch's."""
        if self.push is None:
            return
        if not self.pushed and self.job.done:
            self.pushed = True
            self.push(self, self.sent + [self.guess], self.job.drafts[1:])
        for b in self.branches:
            if not b.pushed and b.job.done:
                b.pushed = True
                self.push(self, b.assumed(self.sent), list(b.job.drafts))


class Lookahead:
    """A draft engine's work ahead: at most one stage or ingest job per sequence."""

    def __init__(self, stats: DraftStats, branches: int = 0):
        self.stats = stats
        self.branches = branches  # fanout: rejections drafted for per stage (0: chain only)
        self.clock = BranchClock()  # fanout: branch passes only in the time a sequence's rounds leave
        self.stages: dict[Hashable, Stage] = {}
        self.ingests: dict[Hashable, DraftJob] = {}
        self.gamma = FIRST_GAMMA  # the drafts a first round is staged for: the last real round's gamma

    def clear(self) -> None:
        self.stages.clear()
        self.ingests.clear()
        self.clock = BranchClock()

    def drop(self, seq_id: Hashable) -> None:
        self.stages.pop(seq_id, None)
        self.ingests.pop(seq_id, None)
        self.clock.drop(seq_id)

    def extent(self) -> int:
        """The longest row any stage can come to hold (0: none staged)."""
        return max((s.extent for s in self.stages.values()), default=0)

    def give_way(self, cache: DraftKVCache) -> None:
        """Every stage dropped and its KV back to what its answered round left: a real round needs the room.
        Ingests stay: their KV is the verified prompt's, which the next round reads anyway."""
        for stage in self.stages.values():
            stage.undo(cache)
            if stage.drafted:
                self.stats.lookahead_wasted += stage.drafted
        self.stages.clear()

    def sequences(self) -> list[Hashable]:
        return list(self.stages) + list(self.ingests)

    def jobs(self) -> list[DraftJob]:
        """The unfinished jobs ahead, at most one per sequence: prompts to ingest and the stages' chains, or
        when there are none, their branches."""
        chains = [j for j in self.ingests.values() if not j.done] + [s.job for s in self.stages.values()
                                                                   if not s.job.done]
        if chains:  # chains first: any chain is a likelier outcome than a branch
            return chains
        return [j for s in self.stages.values() if s.job.done and (j := s.next_job()) is not None
                and self.clock.fits(j.seq_id, s.answered_s)]

    def stage(self, job: DraftJob, cache: DraftKVCache, push: Callable | None = None, branches: int = 0) -> None:
        self.stages[job.seq_id] = stage = Stage.after(job, cache, branches)
        stage.push = push

    def push_done(self) -> None:
        """Send each stage's complete drafts to its target, once each (draft_server.speculate_stream)."""
        for stage in self.stages.values():
            stage.push_done()

    def ingest(self, req: DraftRequest, seq: DraftSeq) -> None:
        """A round that only records tokens (gamma 0): feed the ones the KV lacks, ahead of the next round."""
        read = seq.read
        if len(read) <= len(seq.cached) or seq.cached != read[:len(seq.cached)]:
            return
        job = DraftJob(req.seq_id, seq, 1, read[len(seq.cached):], allow=PREFILL_CHUNK)  # one draft: the guess
        self.ingests[req.seq_id] = job

    def stage_ingested(self, job: DraftJob) -> None:
        """An ingest fed its whole prompt: a stage drafts the sequence's first round from its guess, gamma as
        the last real round asked."""
        self.ingests.pop(job.seq_id, None)
        self.stages[job.seq_id] = Stage.after_ingest(job, self.gamma)
        self.stats.lookahead_drafted += 1  # the guess: a draft a stage may answer with

    def claim(self, req: DraftRequest, cache: DraftKVCache) -> Stage | None:
        """A real round for the sequence ends what was ahead of it: a stage is returned when the round matches
        what it assumed; otherwise its KV goes back to what the answered round left (a miss) and None. An
        ingest's KV is the verified prompt's: it stays for the round's catch-up."""
        self.ingests.pop(req.seq_id, None)
        self.gamma = req.gamma if req.gamma > 0 else self.gamma
        stage = self.stages.pop(req.seq_id, None)
        if stage is not None and self.branches:
            self.clock.returned(req.seq_id, stage.answered_s)
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
        used = stage.hit.job if stage.hit is not None else stage.job
        ready = len(used.drafts) - (used is stage.job)  # past the chain's guess
        self.stats.lookahead_hits += 1
        self.stats.lookahead_branch_hits += stage.hit is not None
        self.stats.lookahead_wasted += stage.drafted - len(used.drafts) + max(0, ready - gamma)
        return stage.take(gamma, cache)
