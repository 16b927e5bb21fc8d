"""What catching the draft up on new prompts costs in this process: the price a policy puts on a lagging draft
(starjar.spec.policies.nightjar's surcharge). Measured, because a profile misses what a loaded process pays."""

from __future__ import annotations

import time


def catch_up_meter(proposer) -> tuple[float, float | None]:
    """The clocks to read after proposing: wall time, and an in-process draft engine's own catch-up seconds."""
    return time.perf_counter(), _draft_clock(proposer)


def _draft_clock(proposer) -> float | None:
    """An in-process draft engine's catch-up seconds so far (draft_server.engine's stats); None for others."""
    return getattr(getattr(proposer, "stats", None), "catchup_s", None)


def report_catch_up(policy, proposer, meter: tuple[float, float | None], want, reqs, replies) -> None:
    """Tell the policy (observe_catch_up) what catching the draft up on prompts it never had cost. A sequence
    resent after a failed round is left out: the draft usually kept its prefix, so the resend is cheap and
    would make every catch-up look cheap. Timed by an in-process draft engine's own catch-up clock where there
    is one (proposing also drafts, which the arms already pay), else by the whole proposing call."""
    tokens = sum(len(d.tokens) for r, d, reply in zip(want, reqs, replies, strict=True)
                 if reply is not None and d.start == 0 and r.req.spec_through == 0)
    if tokens:
        t0, clock0 = meter
        clock = _draft_clock(proposer)
        own = clock0 is not None and clock is not None
        policy.observe_catch_up(tokens, clock - clock0 if own else time.perf_counter() - t0)
