"""One decode step of the target engine as data: each running sequence's round, and the step around them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starjar.spec.token_tree import TokenTree
from starjar.spec.verify import Verdict
from target_worker.request import Request


@dataclass(eq=False)
class SeqRound:
    """One running sequence's part of a decode step."""

    req: Request
    gamma: int  # drafts it may ask for: the batch's gamma, capped by its max_tokens, context and own cap
    draft: list[int] = field(default_factory=list)  # what the proposer gave (may be shorter, or nothing)
    tree: TokenTree | None = None  # a tree proposal instead (draft then holds its tokens, for the counts)
    verdict: Verdict | None = None  # set by the score phase


@dataclass(eq=False)
class DecodePlan:
    """One decode step: the policy's gamma and its sequences, in slot order (the proposer's and the pass's)."""

    gamma: int
    rounds: list[SeqRound]
    started_s: float = field(default_factory=time.perf_counter)  # the step's time counts from here
    scored_s: float = 0.0  # when the score phase began
    # The draft saw some sequence's prompt for the first time this step (a new request, a resync): its prefill
    # is a cost of the request, paid once whatever gamma is, so the policy does not charge it to this gamma.
    draft_prefill: bool = False

    @property
    def drafted(self) -> int:
        return sum(len(r.draft) for r in self.rounds)
