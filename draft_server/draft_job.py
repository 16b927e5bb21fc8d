"""What the draft engine keeps per sequence (DraftSeq), per sequence and round (DraftJob), and its counters."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from draft_server.tree_draft import BeamTree
from starjar.spec.proposer import DraftReply


@dataclass(eq=False)
class DraftSeq:
    slot: int
    seq_id: Hashable = None  # (tag, wire id) on the draft server: how a hidden-state tap names the sequence
    verified: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # tokens whose KV is in the cache, in order
    skip: int = 0  # leading verified tokens the draft never reads (past the model's prompt_window)

    @property
    def read(self) -> list[int]:
        """The verified tokens the draft reads: cached is a prefix of these, at cache positions from 0."""
        return self.verified[self.skip:]


@dataclass(eq=False)
class DraftJob:
    """One sequence's drafting for one round: feed `feed`, take the argmax, until `gamma` drafts."""
    seq_id: Hashable
    seq: DraftSeq
    gamma: int
    feed: list[int]  # the catch-up tokens first, then the last draft
    drafts: list[int] = field(default_factory=list)
    passes: int = 0
    beam: BeamTree | None = None  # a candidate tree instead of a chain (draft_server.tree_draft)
    # Catch-up tokens its next pass may feed, at least 1 (the compute loop's fair share, draft_server.fair_share);
    # None: a whole chunk.
    allow: int | None = None
    # With fanout lookahead: per draft, (its probability, the runner-up, the runner-up's) (draft_server.fanout).
    tops: list[tuple[float, int, float]] = field(default_factory=list)
    branch: object | None = None  # the draft_server.fanout.Branch this job drafts for, if any

    @property
    def done(self) -> bool:
        return self.beam.done if self.beam is not None else len(self.drafts) >= self.gamma

    def reply(self) -> DraftReply:
        return self.beam.tree() if self.beam is not None else self.drafts


@dataclass
class DraftStats:
    rounds: int = 0
    drafted_tokens: int = 0
    catchup_tokens: int = 0  # tokens prefilled before drafting (>= 1 per drafting sequence)
    catchup_s: float = 0.0  # time of those catch-up passes
    seeded_tokens: int = 0  # prompt tokens taken with the target's KV instead (DraftEngine.seed)
    step_s: float = 0.0  # time of the one-token draft steps
    steps: int = 0
    resyncs: int = 0
    passes: int = 0  # draft forward passes (catch-up + one-token steps)
    tree_jobs: int = 0  # sequence-rounds that built a candidate tree
    tree_nodes: int = 0  # nodes of those trees
    tree_expand_s: float = 0.0  # choosing their children and beams (besides the passes they rode in)
    # Lookahead (draft_server.lookahead): rounds whose tokens matched a stage's assumption, rounds that ended
    # a stage otherwise, tokens drafted ahead (guesses included; also in drafted_tokens), and those never used.
    lookahead_hits: int = 0
    lookahead_misses: int = 0
    lookahead_drafted: int = 0
    lookahead_wasted: int = 0
    lookahead_prefilled: int = 0  # prompt tokens fed ahead of their first round (rounds with gamma 0)
    lookahead_branch_hits: int = 0  # hits on a fanout branch (a rejection foreseen), also in lookahead_hits


def tree_row(job: DraftJob):
    """The cache layout of a tree job's beam pass or a fanout branch's pass (None for chains and catch-ups)."""
    if job.branch is not None:
        return job.branch.layout()
    return job.beam.layout() if job.beam is not None and job.passes else None


def logit_rows(job: DraftJob) -> int:
    """How many trailing fed tokens need logits: a beam pass every beam's, everything else its last token's."""
    return len(job.feed) if job.beam is not None and job.passes else 1
