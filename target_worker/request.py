"""One generation request as the target engine tracks it."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from starjar.spec.sampling import PositionDraws, SamplingParams

_ids = itertools.count()
_draft_keys = itertools.count(1)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" (EOS or a stop id) or "length"
    draws: PositionDraws | None = None  # a sampled request's randomness, per position (seeded: repeatable)
    # Timing, in time.perf_counter() seconds.
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    # Speculation, for this request's usage report.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Engine bookkeeping.
    # The draft session's key: unique in this process, whatever request_id a caller chose (two requests
    # with one id must not share, or end, each other's draft state).
    draft_key: int = field(default_factory=lambda: next(_draft_keys))
    slot: int = -1
    draft_synced: int = 0  # how many of all_ids() the proposer has been told about
    # len(all_ids()) after its last speculative step, or the prompt's length where the draft took the prompt with
    # the target's KV: tokens past it came from plain steps
    spec_through: int = 0
    tpot_slo_s: float | None = None  # the time per output token the client asked for (AdaServe), if any
    max_draft_tokens: int | None = None  # the client's cap on drafts per step (0: none); None: the policy's
    stop_ids: frozenset[int] = frozenset()  # tokens that end it (stop ids, EOS unless ignored), set at enqueue

    def __post_init__(self) -> None:
        if self.draws is None and not self.params.greedy:
            self.draws = self.params.make_draws()

    def count_round(self, drafted: int, accepted: int) -> None:
        """One decode step's drafts: `drafted` verified, `accepted` of them kept."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def draft_lag(self) -> int:
        """Tokens the draft must catch up on before it can propose again, beyond the last speculative step's own
        verified tokens: a prompt it never saw, or the tokens of the plain steps since; 0 when it is in step.
        After a failed round the whole sequence is resent, but the draft usually kept what it had been in step
        with, so only the tokens past that count (a draft that really dropped it costs one catch-up more)."""
        return max(0, self.num_tokens - self.spec_through)

    def tokens_left(self) -> int:
        return max(0, self.params.max_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
