"""Lookahead, chain mode: drafting a sequence's likeliest next round while its target verifies this one.

After a round is answered with drafts d1..dg, the likeliest outcome is full acceptance followed by the
target's bonus token, guessed as the draft's own argmax after dg. A Stage drafts for that outcome in the
compute loop's idle time, one pass at a time:

  guess   feed [dg] (one pass): its argmax is the guess b; then the KV goes back to what the round left
          (the verified prefix + d1..d(g-1)), so what follows is computed exactly as a real round would
  chain   the job a real round with verified + d1..dg + b would start: feed [dg, b], then one token a pass,
          until g drafts

A stage is keyed by its sequence, the verified length it assumes (`base`) and the tokens it assumes come
next (`assumed`). The next real round of the sequence ends it: when the round's verified tokens are exactly
verified[:base] + assumed, the round takes the stage's job over (a hit: its drafts so far are kept, and a
complete job answers without a draft pass); otherwise the KV goes back to what the round left (a miss), so
the draft's state is the one a server without lookahead would have.
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
    job: DraftJob  # the guess's one-token job, then the chain's
    guess: int | None = None

    @classmethod
    def after(cls, job: DraftJob) -> Stage:
        """The stage for a finished chain job (its drafts were just answered)."""
        seq = job.seq
        guess_job = DraftJob(job.seq_id, seq, 1, [job.drafts[-1]])
        return cls(seq, len(seq.verified), len(seq.cached), list(job.drafts), guess_job)

    @property
    def drafted(self) -> int:
        """Tokens this stage has drafted: the guess and the chain's drafts."""
        return (self.guess is not None) + (len(self.job.drafts) if self.guess is not None else 0)

    def advanced(self, cache: DraftKVCache) -> None:
        """After a pass: a finished guess starts the chain (from the KV the answered round left)."""
        if self.guess is not None or not self.job.done:
            return
        self.guess = self.job.drafts[0]
        self.undo(cache)
        read = self.seq.read + self.sent + [self.guess]
        self.job = DraftJob(self.job.seq_id, self.seq, len(self.sent), read[self.base_cached:])

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
        """A hit: the chain's job becomes the round's own, asking gamma drafts. One that has them already is
        done (no draft pass), its KV cut to what a real round would leave."""
        job = self.job
        if len(job.drafts) >= gamma:
            keep = len(self.seq.read) + gamma - 1
            cache.truncate(self.seq.slot, keep)
            del self.seq.cached[keep:]
            del job.drafts[gamma:]
            job.feed = [job.drafts[-1]]
        job.gamma = gamma
        return job

    def undo(self, cache: DraftKVCache) -> None:
        """The KV back to what the answered round left."""
        if len(self.seq.cached) > self.base_cached:
            cache.truncate(self.seq.slot, self.base_cached)
            del self.seq.cached[self.base_cached:]
