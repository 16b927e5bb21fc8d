"""Each target's fair share of a draft pass's catch-up work.

A draft step costs a sequence one fed token; a catch-up (a new sequence's
prompt, a resync, the tokens of many speculation-free steps) costs all of its
tokens, and one target can send a great many: 256 sequences of 511 tokens are
130k tokens, tens of seconds of a CPU draft in passes that held every other
target's rounds. So a compute-loop pass feeds:
- every job's short feed (a draft step, or an ordinary round's accepted drafts
  and bonus token: at most SHORT_FEED tokens), whoever it belongs to, once
  its round has no catch-up left (the round is answered when all its jobs
  are, so its steps wait and then go as one batch);
- at most `budget` catch-up tokens in all (one per target where there are
  more targets than that), shared between the targets that have catch-up
  waiting in proportion to how many of their sequences wait (at most
  WEIGHT_CAP shares to a target, however many it sends), a target's share
  going to its jobs in the order its rounds came, in whole chunks where they
  fit. A share a target cannot use goes to the others.
A round therefore waits at most one bounded pass behind other targets' prompts
(never behind their whole rounds), and its own catch-up moves at its share.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from draft_server.engine import MAX_FEED, SHORT_FEED, DraftJob

WEIGHT_CAP = 4  # shares one target may claim for its waiting catch-ups


def catching_up(job: DraftJob) -> bool:
    """Whether the job's next feed is a catch-up longer than a short feed (a tree's beam pass never is)."""
    return job.passes == 0 and len(job.feed) > SHORT_FEED


def plan(rounds: Sequence[tuple[Hashable, Sequence[DraftJob]]], budget: int) -> list[DraftJob]:
    """rounds: (owner, its unfinished jobs) per round in flight, in arrival order. Returns the jobs for the next
    pass, each catch-up among them with its `allow` set: how many tokens it may feed (at least 1)."""
    picked: list[DraftJob] = []
    waiting: dict[Hashable, list[DraftJob]] = {}
    for owner, jobs in rounds:
        long = [j for j in jobs if catching_up(j)]
        if long:  # a round is answered when all its jobs are: its draft steps wait for its catch-ups, then batch
            waiting.setdefault(owner, []).extend(long)
            continue
        for job in jobs:
            job.allow = None
        picked += jobs
    need = {o: sum(min(len(j.feed), MAX_FEED) for j in js) for o, js in waiting.items()}
    grants = split(max(1, budget), need, {o: min(len(js), WEIGHT_CAP) for o, js in waiting.items()})
    for owner, js in waiting.items():
        left = grants[owner]
        for job in js:
            whole = min(len(job.feed), MAX_FEED)
            # Whole chunks while they fit (a cut one would be a pass of its own length); a cut one only when
            # no whole one fits, so that every share moves.
            if left <= 0 or (whole > left and job is not js[0]):
                break
            job.allow = min(whole, left)
            left -= job.allow
            picked.append(job)
    return picked


def split(budget: int, need: dict[Hashable, int], weight: dict[Hashable, int]) -> dict[Hashable, int]:
    """Water-filling: `budget` tokens shared by weight, no owner given more than it needs, what one cannot use
    shared again among the rest. Every owner that needs any gets at least one token, even past the budget: with
    more owners than tokens, a fixed order would otherwise starve the last ones."""
    grant = {o: min(1, n) for o, n in need.items()}
    hungry = [o for o in need if grant[o] < need[o]]
    left = budget - sum(grant.values())
    while left > 0 and hungry:
        total, pool = sum(weight[o] for o in hungry), left
        for o in hungry:
            give = min(max(1, pool * weight[o] // total), need[o] - grant[o], left)
            grant[o] += give
            left -= give
        hungry = [o for o in hungry if grant[o] < need[o]]
    return grant
