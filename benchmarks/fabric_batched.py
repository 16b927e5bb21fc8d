"""The batched mode's workload: a dry replay that drafts in batched passes the way the batched server does.

A batched draft server runs one pass over the rows of every round in flight, and multi-row passes draft
(slightly) different tokens than one-row passes: with int8 drafts a pass of one row quantizes its
activations with that row's own range, several rows go through a shared one (starjar/cpu/quantized.py). The
tokens a round gains therefore depend on how rounds share passes, and a single-row dry replay overstates
them for the batched mode. Here `targets` replay targets draft against the real engine in virtual time,
scheduled as draft_server/compute.py's batched loop schedules them: every iteration starts the rounds that
arrived and runs one pass over every unfinished job; a pass lasts the calibrated cost of its rows, a target
sends its next round Z after its drafts. Drafts are greedy, so the rounds depend only on that schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.sims.fabric_sim import PassCost, Round, as_round
from draft_server.engine import DraftEngine
from target_worker.replay import ReplaySequence, ReplayTarget


@dataclass(eq=False)
class _Target:
    replay: ReplayTarget
    order: list[int]  # script numbers in the order this target serves them
    k: int = 0  # position in `order`
    seq: ReplaySequence | None = None
    ready_s: float = 0.0  # when its next round arrives at the server
    rounds: list[Round] = field(default_factory=list)  # of the request in progress
    flight: tuple | None = None  # (requests, replies, jobs) of its round in flight


def batched_rounds(engine: DraftEngine, scripts, gamma: int, targets: int, pass_s: PassCost, z_s: float,
                   max_rounds: int = 4000) -> list[list[Round] | None]:
    """Each script's rounds as the first of `targets` batched targets to finish it got them (None: none did
    within max_rounds). Target k serves the scripts in turn from the k-th, as the replay bench's do."""
    ts = [_Target(ReplayTarget(engine, gamma, 0.0), [(k + i) % len(scripts) for i in range(len(scripts))])
          for k in range(targets)]
    out: list[list[Round] | None] = [None] * len(scripts)
    now, served = 0.0, 0
    while served < max_rounds and any(r is None for r in out):
        for t in ts:
            if t.flight is None and t.ready_s <= now:
                _send(engine, scripts, t)
        live = [j for t in ts if t.flight for _, j in t.flight[2] if not j.done]
        if not any(t.flight for t in ts):
            now = min(t.ready_s for t in ts)
            continue
        if live:
            engine.advance(live)
            now += pass_s(len(live))
        for t in ts:
            if t.flight and all(j.done for _, j in t.flight[2]):
                served += 1
                _answer(engine, t, out, now + z_s)
    engine.release([id(t.seq) for t in ts if t.seq is not None])  # sequences mid-request: the next call's ids
    return out


def _send(engine: DraftEngine, scripts, t: _Target) -> None:
    if t.seq is None:
        prompt, continuation = scripts[t.order[t.k % len(t.order)]]
        t.seq, t.rounds = ReplaySequence(list(prompt), list(continuation)), []
    reqs = t.replay.requests([t.seq])
    replies, jobs = engine.start(reqs)
    t.flight = (reqs, replies, jobs)


def _answer(engine: DraftEngine, t: _Target, out: list, next_s: float) -> None:
    """The target verifies its drafts and notes the round; a finished request is kept for its script."""
    reqs, replies, jobs = t.flight
    for i, job in jobs:
        replies[i] = job.reply()
    before = t.replay.stats.tokens
    t.replay.verify([t.seq], reqs, replies)
    t.rounds.append(as_round(reqs[0], t.replay.stats.tokens - before))
    t.flight, t.ready_s = None, next_s
    if t.seq.done:
        engine.release([id(t.seq)])
        script = t.order[t.k % len(t.order)]
        if out[script] is None:
            out[script] = t.rounds
        t.seq, t.k = None, t.k + 1


def batched_workloads(engine: DraftEngine, scripts, gamma: int, single: list[list[Round]], pass_s: PassCost,
                      z_s: float, sizes=(2, 4, 8)) -> dict[int, list[list[Round]]]:
    """The batched workload by targets per draft server (1: the single-row dry replay's); a script no batched
    target finished keeps its single-row rounds."""
    out = {1: single}
    for n in sizes:
        got = batched_rounds(engine, scripts, gamma, n, pass_s, z_s)
        out[n] = [g if g is not None else s for g, s in zip(got, single, strict=True)]
    return out


def for_targets(workloads: dict, per_server: int) -> list[list[Round]]:
    """The workload measured with the most targets per server up to `per_server` (the largest beyond them)."""
    fits = [n for n in workloads if int(n) <= per_server]
    return workloads[max(fits, key=int) if fits else min(workloads, key=int)]
