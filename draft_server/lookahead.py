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

A hit's drafts come from one-token passes where a server without lookahead feeds [dg, b] in one pass; they
may differ in the last bits of the logits, so rarely in a token. What a request outputs never depends on its
drafts (verification decides; seeded draws depend on the position alone, starjar.spec.sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

from draft_server.draft_job import DraftJob, DraftSeq
from draft_server.kv_pool import DraftKVCache
from starjar.spec.proposer import DraftRequest

MODES = ("off", "chain")


@dataclass(eq=False)
class Stage:
    seq: DraftSeq
    base: int  # len(seq.verified) when the round was answered
    base_cached: int  # len(seq.cached) then: the KV a server without lookahead holds
    sent: list[int]  # the drafts that round answered (d1..dg)
    job: DraftJob  # fed [dg]: its first draft is the guess, the rest the next round's

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
