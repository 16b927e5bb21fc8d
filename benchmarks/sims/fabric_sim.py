"""A discrete-event simulation of the star with M draft servers (a projection, labeled as one).

It schedules the way draft_server/compute.py does, at the level of forward passes, not of whole rounds:
- each target cycles: it sends a round to its draft server, the round waits in that server's queue, is
  drafted, and the target sends its next one Z later (verification plus wire);
- `batched`: every iteration of a server's loop takes the rounds that arrived (up to max_batch_rounds in
  flight) and runs ONE pass over every unfinished round of every target; a round is answered after its
  gamma passes, and a round that arrives meanwhile joins the very next pass;
- `fifo`: one round at a time, its gamma passes back to back, as StarSD does;
- a pass's rows are grouped as starjar/model/grouped_forward.py groups them: short rows (one-token steps and a
  usual round's catch-up) share a pass padded to the widest, costing step(b) for b one-token rows and more
  with the width (catchup(b) at the measured catch-up width); a new sequence's prompt (its catch-up
  prefill) is a pass of its own costing prefill(tokens);
- servers on one host (Hosts) share its cores: while k of them are busy, each runs its passes slowdown(k)
  times as long (measured contention; processor sharing). The validation puts the M servers on this
  machine, as the replay bench runs them; the projection gives each server a host (a device) of its own;
- every round also costs `round_s` of the loop's bookkeeping (starting it, answering it).
The costs are measured on this machine (benchmarks/fabric_costs.py); the workload is each request's rounds
(passes, tokens gained, prefill) as a dry replay of the scripts gives them. Targets are assigned with the
controller's own rules (controller/fleet/assignment.py); one no draft server admits decodes alone, one
token per `plain_step_s`. A server's load is its busy time (its passes and bookkeeping) over the wall time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from controller.fleet import admission
from controller.fleet.assignment import Assignment, DraftSlot, place
from draft_server.config import DraftServerConfig
from draft_server.engine import SHORT_FEED  # rows feeding at most this many tokens share a pass
from starjar.model.grouped_forward import length_groups
from starjar.spec.proposer import DraftRequest


@dataclass
class PassCost:
    """Seconds of one pass as a function of its size x (rows, or fed tokens): linear between measured points,
    and along the last segment beyond them."""

    points: list[tuple[float, float]]  # (size, seconds), at least one

    def __post_init__(self):
        self._sorted = sorted(self.points)

    def __call__(self, b: float) -> float:
        pts = self._sorted
        if len(pts) == 1:
            return pts[0][1]
        k = next((k for k in range(1, len(pts)) if b <= pts[k][0]), len(pts) - 1)  # the segment holding b
        (b0, c0), (b1, c1) = pts[k - 1], pts[k]
        return max(1e-6, c0 + (c1 - c0) * (b - b0) / (b1 - b0)) if b1 != b0 else c1


@dataclass(frozen=True)
class Hosts:
    """Where the draft servers run. Servers on one host share its cores: while k of them are busy at once,
    each one's passes run slowdown(k) times as long as alone (processor sharing; the slowdown changes the
    moment another server of the host starts or stops). `contention[k - 1]` is measured (k engines drafting
    at once in separate processes on one host, benchmarks/fabric_costs.contention); past the measured k, a
    host whose threads outnumber its cores time-shares them: k x threads / cores."""

    per_host: int = 1  # draft servers per host: server d runs on host d // per_host (1: a host, a device, each)
    cores: int = 1
    threads: int = 1  # torch threads of each draft server
    contention: tuple[float, ...] = (1.0,)  # slowdown with 1, 2, ... servers of one host busy at once

    def slowdown(self, busy: int) -> float:
        if busy <= 1:
            return 1.0
        if busy <= len(self.contention):
            return self.contention[busy - 1]
        return max(self.contention[-1], busy * self.threads / self.cores)

    def host(self, server: int) -> int:
        return server // self.per_host


@dataclass(frozen=True)
class Round:
    passes: int  # draft passes it needs (its gamma; 0: answered without a pass)
    tokens: float  # tokens the target gains from it (accepted drafts + its own)
    prefill: int = 0  # catch-up tokens of its first pass (a new sequence's prompt), when longer than SHORT_FEED
    feed: int = 1  # tokens its first pass feeds when short (the accepted drafts and the bonus token)


@dataclass
class StarModel:
    z_s: float  # a target's return time: from drafts received to its next round
    tokens_per_round: float  # accepted drafts + 1, per round (the workload when `scripts` is None)
    plain_step_s: float  # a step without drafts (one token)
    cost: PassCost  # step(b): a pass over b short rows
    mode: str = "fifo"  # fifo | batched
    wake_s: float = 0.0  # extra time of an iteration that starts after an idle gap
    n_max: int = 64  # targets per draft server
    prefill: PassCost | None = None  # a pass feeding one new sequence's prompt, by fed tokens (None: step(1))
    round_s: float = 0.0  # the loop's bookkeeping per round
    gamma: int = 4
    max_batch_rounds: int = DraftServerConfig.max_batch_rounds
    scripts: list[list[Round]] | None = None  # each request's rounds; target i serves them in turn from i
    hosts: Hosts = field(default_factory=Hosts)  # default: each draft server on a host of its own
    # A short pass is padded to its longest row: catchup(b) is a pass over b rows feeding catchup_width
    # tokens each; between width 1 (cost) and that, linear in the width (None: width costs nothing).
    catchup: PassCost | None = None
    catchup_width: float = 3.0  # the median width the calibration's catch-ups really fed

    def short_pass(self, rows: int, width: int) -> float:
        """Seconds of a pass over `rows` short rows padded to `width` fed tokens."""
        one = self.cost(rows)
        if self.catchup is None or width <= 1:
            return one
        return one + (self.catchup(rows) - one) * (width - 1) / max(0.5, self.catchup_width - 1)

    def rounds_of(self, target: int):
        """A target's endless sequence of rounds (StarSD's targets serve one request at a time)."""
        if not self.scripts:
            while True:
                yield Round(self.gamma, self.tokens_per_round)
        if not any(self.scripts):
            raise ValueError("scripts: every script is empty (no round to serve)")
        k = target
        while True:
            yield from self.scripts[k % len(self.scripts)]
            k += 1


@dataclass(eq=False)
class _Job:
    target: int
    rnd: Round
    left: int  # passes still to run
    fresh: bool = True  # its first pass is still to run


@dataclass
class _Draft:
    queue: list[tuple[int, Round]] = field(default_factory=list)
    active: list[_Job] = field(default_factory=list)
    busy_s: float = 0.0
    serving: bool = False
    passes: int = 0  # forward passes run
    rows: int = 0  # rows over those passes (rows / passes: the mean batch)
    iterations: int = 0  # loop iterations (what GetStats counts as batches)
    rounds: int = 0  # rounds answered


def assign(n_targets: int, m_drafts: int, n_max: int) -> dict[str, str | None]:
    slots = [DraftSlot(f"d{j}", "fp", n_max, live=True) for j in range(m_drafts)]
    a = Assignment({f"t{i}": None for i in range(n_targets)})
    place(slots, a, {t: "fp" for t in a.of})
    return a.of


def iteration_cost(model: StarModel, dr: _Draft, taken: int) -> tuple[float, list[_Job]]:
    """One loop iteration over the jobs in flight: its seconds, and the jobs it finishes (their passes run)."""
    live = [j for j in dr.active if j.left > 0]
    cost = model.round_s * taken
    if model.mode == "fifo" and len(live) == 1:  # nothing can join: the round's passes all at once
        return cost + _whole_round(model, dr, live[0]), list(dr.active)
    feed = {id(j): (j.rnd.prefill if j.rnd.prefill > SHORT_FEED else j.rnd.feed) if j.fresh else 1 for j in live}
    if all(f <= SHORT_FEED for f in feed.values()):  # the usual case: one pass over short rows
        groups = [live] if live else []
    else:
        groups = length_groups(live, lambda j: feed[id(j)], short=SHORT_FEED)
    for group in groups:
        longest = max(feed[id(j)] for j in group)
        if longest > SHORT_FEED and model.prefill is not None:  # a padded pass feeds rows x the longest
            cost += model.prefill(longest * len(group))
        else:
            cost += model.short_pass(len(group), longest)
        dr.passes += 1
        dr.rows += len(group)
    for j in live:
        j.left -= 1
        j.fresh = False
    return cost, [j for j in dr.active if j.left <= 0]


def _whole_round(model: StarModel, dr: _Draft, j: _Job) -> float:
    """The seconds of all of a lone round's passes (fifo), counted as the loop would count them."""
    long = j.rnd.prefill > SHORT_FEED
    first = model.prefill(j.rnd.prefill) if long and model.prefill else model.short_pass(1, 1 if long else j.rnd.feed)
    dr.passes += j.left
    dr.rows += j.left
    dr.iterations += j.left - 1  # the caller counts one
    cost = first + (j.left - 1) * model.cost(1)
    j.left, j.fresh = 0, False
    return cost


def _take(model: StarModel, dr: _Draft) -> int:
    """The rounds this iteration takes from the queue (compute.py: fifo only when nothing is in flight)."""
    if model.mode == "fifo":
        room = 0 if dr.active else 1
    else:
        room = max(0, model.max_batch_rounds - len(dr.active))
    taken, dr.queue = dr.queue[:room], dr.queue[room:]
    dr.active += [_Job(t, r, r.passes) for t, r in taken]
    return len(taken)


class _Run:
    """One simulated run: N targets, M draft servers, the event queue."""

    def __init__(self, model: StarModel, where: dict[int, int | None], m_drafts: int, stop_s: float):
        """where: each target's draft server (None: it decodes alone); a target's number picks its scripts."""
        self.model, self.stop_s, self.where = model, stop_s, where
        self.drafts = [_Draft() for _ in range(m_drafts)]
        self.scripts = {i: model.rounds_of(i) for i in where}
        self.events: list[tuple[float, int, str, int, list]] = []
        self.seq = 0
        self.tokens = 0.0
        self.end_s = 0.0  # when the last target finished
        # Iterations in progress: server -> [work left (seconds alone), started at, its end event, its jobs].
        self.running: dict[int, list] = {}
        self.clock: dict[int, float] = {}  # host -> when its servers' work left was last brought up to date

    def push(self, t: float, kind: str, who: int, jobs: list | None = None) -> int:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, who, jobs or []))
        return self.seq

    def iterate(self, d: int, t: float, idle: bool) -> None:
        dr = self.drafts[d]
        taken = _take(self.model, dr)
        if not dr.active:
            dr.serving = False
            return
        cost, done = iteration_cost(self.model, dr, taken)
        cost += self.model.wake_s if idle else 0.0
        dr.serving, dr.iterations = True, dr.iterations + 1
        self.share(t, d, [cost, t, 0, done])

    def share(self, t: float, d: int, start: list | None = None) -> None:
        """Server d starts an iteration (`start`) or ends one (None) at t. Its host's busy servers progress
        at 1 / slowdown(busy servers) until t, and their ends are set again at the new slowdown."""
        hosts = self.model.hosts
        h = hosts.host(d)
        mine = [s for s in range(h * hosts.per_host, (h + 1) * hosts.per_host) if s in self.running]
        slow = hosts.slowdown(len(mine))
        for s in mine:
            self.running[s][0] -= (t - self.clock[h]) / slow
        self.clock[h] = t
        if start is None:
            mine.remove(d)
            del self.running[d]
        else:
            mine.append(d)
            self.running[d] = start
        slow = hosts.slowdown(len(mine))
        for s in mine:  # the end events set before are stale now (step() skips them)
            work = self.running[s]
            work[2] = self.push(t + max(0.0, work[0]) * slow, "iter", s, work[3])

    def step(self, t: float, kind: str, who: int, jobs: list, seq: int = 0) -> None:
        m = self.model
        if kind == "plain":
            if t < self.stop_s:
                self.tokens += 1
                self.push(t + m.plain_step_s, "plain", who)
            self.end_s = max(self.end_s, t)
        elif kind == "send":
            if t >= self.stop_s:  # the target's time is up: it stops after its last verification
                self.end_s = max(self.end_s, t)
                return
            dr = self.drafts[self.where[who]]
            dr.queue.append((who, next(self.scripts[who])))
            if not dr.serving:
                self.iterate(self.where[who], t, idle=True)
        elif self.running.get(who, (0, 0, -1))[2] == seq:  # an iteration of server `who` ends (not a stale end)
            dr = self.drafts[who]
            dr.busy_s += t - self.running[who][1]
            self.share(t, who)
            dr.rounds += len(jobs)
            for j in jobs:
                self.tokens += j.rnd.tokens
                self.push(t + m.z_s, "send", j.target)
            dr.active = [j for j in dr.active if j.left > 0]
            self.iterate(who, t, idle=False)


def simulate(model: StarModel, n_targets: int, m_drafts: int, cycles: int = 200, duration_s: float | None = None,
             together: bool = False) -> dict:
    """System tokens/s and mean draft load. Every target sends rounds until `duration_s` (default: `cycles`
    unloaded cycles) and stops after the verification of its last one; tokens and busy time are over the wall
    time to then. together: all targets start at 0, as the replay bench starts them (default: spread over
    one cycle, a steady state; then draft servers with as many targets are alike, and one of each is run)."""
    stop = duration_s if duration_s is not None else cycles * (model.z_s + model.gamma * model.cost(1))
    of = assign(n_targets, m_drafts, model.n_max)
    where = {i: None if of[f"t{i}"] is None else int(of[f"t{i}"][1:]) for i in range(n_targets)}
    if together or duration_s is not None or model.hosts.per_host > 1:  # servers sharing a host run together
        runs = [(_Run(model, where, m_drafts, stop), 1)]
    else:
        runs = _alike(model, where, m_drafts, stop)
    for run, _ in runs:
        for i, d in run.where.items():
            run.push(0.0 if together else model.z_s * i / max(1, n_targets), "send" if d is not None else "plain", i)
        while run.events:
            t, seq, kind, who, jobs = heapq.heappop(run.events)
            run.step(t, kind, who, jobs, seq)
    return _summary(runs, m_drafts, sum(d is None for d in where.values()))


def _alike(model: StarModel, where: dict, m_drafts: int, stop: float) -> list[tuple[_Run, int]]:
    """One run per number of targets a draft server holds (weighted by how many servers hold that many),
    and one for the targets that decode alone."""
    held: dict[int, list[int]] = {}
    for i, d in where.items():
        if d is not None:
            held.setdefault(d, []).append(i)
    first: dict[int, tuple[list[int], int]] = {}
    for targets in held.values():
        ts, count = first.get(len(targets), (targets, 0))
        first[len(targets)] = (ts, count + 1)
    runs = [(_Run(model, dict.fromkeys(ts, 0), 1, stop), count) for ts, count in first.values()]
    alone = [i for i, d in where.items() if d is None]
    return runs + ([(_Run(model, dict.fromkeys(alone), 0, stop), 1)] if alone else [])


def _summary(runs: list[tuple[_Run, int]], m_drafts: int, without: int) -> dict:
    wall = max(max(run.end_s for run, _ in runs), 1e-9)
    drafts = [(d, count) for run, count in runs for d in run.drafts]
    load = [min(1.0, d.busy_s / wall) for d, count in drafts for _ in range(count)]
    load += [0.0] * (m_drafts - len(load))  # servers with no target
    tot = {k: sum(getattr(d, k) * count for d, count in drafts) for k in ("passes", "rounds", "rows", "busy_s",
                                                                          "iterations")}
    rounds = tot["rounds"]
    return {"system_tokens_per_s": sum(run.tokens * count for run, count in runs) / wall,
            "draft_load": sum(load) / len(load) if load else 0.0, "loads": load, "without_draft": without,
            "wall_s": wall, "rounds": rounds, "rows_per_pass": tot["rows"] / tot["passes"] if tot["passes"] else 0.0,
            "busy_per_round_s": tot["busy_s"] / rounds if rounds else 0.0,
            "passes_per_round": tot["iterations"] / rounds if rounds else 0.0}


def drafts_needed(model: StarModel, n_targets: int, share: float = 0.9, cycles: int = 100) -> int:
    """The fewest draft servers at which the system makes `share` of what N unsaturated targets make (each as
    fast as one target alone with its own draft server): binary search, the throughput grows with M."""
    alone = simulate(model, 1, 1, cycles)["system_tokens_per_s"]
    goal = share * alone * n_targets
    lo, hi = 1, max(1, n_targets)
    while lo < hi:
        mid = (lo + hi) // 2
        if simulate(model, n_targets, mid, cycles)["system_tokens_per_s"] >= goal:
            hi = mid
        else:
            lo = mid + 1
    return lo


def service_s(model: StarModel) -> float:
    """A usual round's fifo service time S: gamma one-row passes and its bookkeeping."""
    return model.gamma * model.cost(1) + model.round_s


def n_full(model: StarModel) -> int:
    """StarSD's N_full for this model's fifo service time."""
    return admission.n_full(model.z_s, service_s(model))


def as_round(r: DraftRequest, gained: int) -> Round:
    """A request as the simulator sees it: its passes, the tokens it gained and what its first pass feeds.

    A later request's first pass feeds only what the draft's KV lacks: it holds its own drafts but the last,
    and the accepted ones match them, so 2 tokens after a full accept (the last draft and the bonus), else 1."""
    prompt = r.start == 0 and len(r.tokens) > SHORT_FEED
    if prompt:
        return Round(r.gamma, gained, len(r.tokens), 1)
    feed = len(r.tokens) if r.start == 0 else 2 if len(r.tokens) > r.gamma else 1
    return Round(r.gamma, gained, 0, max(1, feed))
