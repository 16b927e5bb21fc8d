"""Replay targets: the draft server and the wire run for real, the target does not.

Two cores cannot host several real target models at once, so the star-scaling
benchmark replaces target compute by a replay: each sequence verifies the
drafts against the target's own recorded greedy continuation (so acceptance
is exactly what the real target would give), and each round sleeps for the
recorded (or chosen) verification time. Results from it are labeled replay.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from starjar.spec.proposer import DraftRequest, Proposer


@dataclass(eq=False)
class ReplaySequence:
    prompt_ids: list[int]
    continuation: list[int]  # the target's greedy output for this prompt
    emitted: int = 0
    synced: int = 0  # tokens the proposer has been told about

    @property
    def done(self) -> bool:
        return self.emitted >= len(self.continuation)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.continuation[: self.emitted]


@dataclass
class ReplayStats:
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallbacks: int = 0
    round_s: list[float] = field(default_factory=list)


class ReplayTarget:
    """A batch of sequences decoded speculatively against recorded continuations."""

    def __init__(self, proposer: Proposer, gamma: int, verify_s: float):
        self.proposer = proposer
        self.gamma = gamma
        self.verify_s = verify_s  # wall time one verification pass takes on the real target
        self.stats = ReplayStats()

    def run(self, scripts: Sequence[tuple[list[int], list[int]]], until_s: float | None = None) -> ReplayStats:
        """Decode every script to its end; with until_s, restart finished ones until the time is up."""
        stop_at = None if until_s is None else time.perf_counter() + until_s
        batch = [ReplaySequence(list(p), list(c)) for p, c in scripts]
        while batch:
            self._round(batch)
            expired = stop_at is not None and time.perf_counter() >= stop_at
            for i, seq in enumerate(batch):
                if seq.done or expired:
                    self.proposer.release([id(seq)])
                    if seq.done and stop_at is not None and not expired:
                        batch[i] = ReplaySequence(seq.prompt_ids, seq.continuation)
            batch = [] if expired else [s for s in batch if not s.done]
        return self.stats

    def run_in_turn(self, scripts: Sequence[tuple[list[int], list[int]]], until_s: float) -> ReplayStats:
        """One request at a time, as StarSD's targets serve: the scripts in turn, from the first, round and
        round until the time is up."""
        stop_at = time.perf_counter() + until_s
        k = 0
        while True:
            p, c = scripts[k % len(scripts)]
            seq = ReplaySequence(list(p), list(c))
            while not seq.done and time.perf_counter() < stop_at:
                self._round([seq])
            self.proposer.release([id(seq)])
            if not seq.done:
                return self.stats
            k += 1

    def _round(self, batch: list[ReplaySequence]) -> None:
        t0 = time.perf_counter()
        reqs = self.requests(batch)
        try:
            replies = self.proposer.propose(reqs)
        except Exception:  # a failed round is a speculation-free step, as on a real target
            replies = [None] * len(reqs)
            self.stats.fallbacks += 1
        self.verify(batch, reqs, replies)
        time.sleep(self.verify_s)  # the verification pass, replayed
        self.stats.round_s.append(time.perf_counter() - t0)

    def requests(self, batch: list[ReplaySequence]) -> list[DraftRequest]:
        """A round's draft requests: each sequence's tokens since the last sync, and up to gamma drafts."""
        reqs = []
        for s in batch:
            toks = s.tokens()
            g = max(0, min(self.gamma, len(s.continuation) - s.emitted - 1))
            reqs.append(DraftRequest(id(s), s.synced, toks[s.synced:], g))
        return reqs

    def verify(self, batch: list[ReplaySequence], reqs: list[DraftRequest], replies: list) -> None:
        """Accept each sequence's drafts up to the first that differs from its recorded continuation, plus the
        target's own next token (None: the proposer lost the sequence; it resyncs from 0 next round)."""
        for s, r, req in zip(batch, replies, reqs, strict=True):
            if r is None:
                s.synced, r = 0, []
            else:
                s.synced = req.start + len(req.tokens)
            want = s.continuation[s.emitted:]
            k = 0
            while k < len(r) and k < len(want) - 1 and r[k] == want[k]:
                k += 1
            s.emitted += k + 1  # accepted drafts + the target's own next token
            self.stats.drafted += len(r)
            self.stats.accepted += k
            self.stats.tokens += k + 1
        self.stats.rounds += 1
