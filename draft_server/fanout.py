"""Lookahead, fanout mode: besides the chain, drafting ahead for the likeliest rejections of a round.

A round answered with drafts d1..dg is rejected at point p when the target keeps d1..dp and corrects d(p+1)
to another token c. Once the chain (full acceptance) is staged, idle time left goes to the likeliest such
outcomes: c is the draft's own second choice at that point, and an outcome's likelihood is the draft's
estimate q(d1)..q(dp) q(c). A branch feeds c and drafts past it, as the chain does past its guess.

A branch's KV goes past the chain's as a token-tree row (RaggedKVCache.begin): each of its tokens takes
the position it would hold after d1..dp and sees only the sequence up to there and the branch itself. When
the next round turns out to be the branch's outcome, its KV moves to those positions and everything past
them is cut: the sequence then holds what a round that drafted after c would.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from draft_server.draft_job import DraftJob
from draft_server.kv_pool import DraftKVCache

BRANCHES = 2  # branches a stage drafts at most: each takes g idle passes after the chain's g + 1
MIN_LIKELIHOOD = 0.02  # an outcome the draft rates below this is not worth its passes
EMA = 0.3  # weight of the newest sample in BranchClock's averages


def top_two(logits: torch.Tensor) -> tuple[int, tuple[float, int, float]]:
    """The argmax of one row of logits and (its probability, the runner-up, the runner-up's probability). The
    draft is argmax's (the first of equal logits), as without fanout: topk's order among ties is unspecified."""
    token = int(logits.argmax())
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, 2).indices.tolist()
    runner_up = top[1] if top[0] == token else top[0]
    return token, (float(probs[token]), int(runner_up), float(probs[runner_up]))


def likeliest_rejections(tops: list[tuple[float, int, float]], count: int) -> list[tuple[float, int, int]]:
    """(likelihood, point, correction) of the `count` likeliest rejections of a round whose drafts had these
    top_two() figures, likeliest first, none below MIN_LIKELIHOOD."""
    kept, found = 1.0, []
    for point, (q, alt, q_alt) in enumerate(tops):
        found.append((kept * q_alt, point, alt))
        kept *= q
    found.sort(key=lambda f: -f[0])
    return [f for f in found[:count] if f[0] >= MIN_LIKELIHOOD]


class BranchClock:
    """Whether a branch pass still ends before the sequence's next round is likely to come. A branch is an
    unlikely outcome: a pass for it that a real round has to wait on costs more than it is likely to save, so
    branches use only the idle time a sequence's rounds leave (measured: with no such guard, the default pair on
    a 2-core AMD EPYC, draft and target on a core each, decoded at 0.93x the chain's speed)."""

    def __init__(self):
        self.returns: dict[Hashable, float] = {}  # per sequence: seconds from a round's answer to its next round
        self.pass_s = 0.0  # a branch pass's seconds

    def returned(self, seq_id: Hashable, answered_s: float) -> None:
        took = time.perf_counter() - answered_s
        last = self.returns.get(seq_id)
        self.returns[seq_id] = took if last is None else last + EMA * (took - last)

    def passed(self, seconds: float) -> None:
        self.pass_s = seconds if not self.pass_s else self.pass_s + EMA * (seconds - self.pass_s)

    def fits(self, seq_id: Hashable, answered_s: float) -> bool:
        """Unknown before the sequence's second round (then yes). A round is seen when the pass it came
        during has ended, so a return time may be a pass too long: a branch pass must end a pass early."""
        expected = self.returns.get(seq_id)
        return expected is None or time.perf_counter() - answered_s + 2 * self.pass_s <= expected

    def drop(self, seq_id: Hashable) -> None:
        self.returns.pop(seq_id, None)


@dataclass(eq=False)
class Branch:
    point: int  # drafts the outcome keeps before its correction
    token: int  # the correction guessed
    likelihood: float
    root: int  # the cache position of the token before the correction (the tree row's root)
    job: DraftJob  # fed [token]: its drafts are the next round's
    cache: DraftKVCache
    positions: list[int] = field(default_factory=list)  # where its fed tokens' KV went, in feed order
    pushed: bool = False

    def assumed(self, sent: list[int]) -> list[int]:
        return sent[:self.point] + [self.token]

    def layout(self) -> tuple[int, list[int]]:
        """The tree row of this branch's next pass (RaggedKVCache.begin): the region from the root to the
        slot's end, where its own tokens form a path from the root and every other token (the chain's, other
        branches') hangs off the root, unseen. Called once per pass, right before it: where the fed token
        goes is recorded here."""
        end = self.cache.lengths[self.job.seq.slot]
        parents = [-1] + [0] * (end - self.root - 1)
        for prev, pos in zip([self.root] + self.positions, self.positions, strict=False):
            parents[pos - self.root] = prev - self.root
        parents.append((self.positions[-1] if self.positions else self.root) - self.root)
        self.positions.append(end)
        return end - self.root, parents

    def take(self, gamma: int) -> DraftJob:
        """A hit (the round already applied): the branch's KV moved to its true positions, everything past
        them cut, and its drafts the round's job (done when it has gamma of them, as Stage.take)."""
        seq, n = self.job.seq, len(self.positions)
        start = self.root + 1
        self.cache.move(seq.slot, self.positions, list(range(start, start + n)))
        self.cache.truncate(seq.slot, start + n)
        del seq.cached[start:]
        seq.cached.extend([self.token] + self.job.drafts[:n - 1])  # what it fed: the correction, then its drafts
        job = DraftJob(self.job.seq_id, seq, gamma, list(self.job.feed), drafts=list(self.job.drafts),
                       passes=self.job.passes, tops=list(self.job.tops))
        return cut_to(job, gamma, self.cache)


def cut_to(job: DraftJob, gamma: int, cache: DraftKVCache) -> DraftJob:
    """A job taken from work ahead that has at least gamma drafts is done: its KV cut to what a real round
    would leave (the verified tokens and the first gamma - 1 drafts) and its drafts to gamma."""
    if len(job.drafts) >= gamma:
        seq = job.seq
        keep = len(seq.read) + gamma - 1
        cache.truncate(seq.slot, keep)
        del seq.cached[keep:]
        del job.drafts[gamma:], job.tops[gamma:]
        job.feed = [job.drafts[-1]]
    return job
