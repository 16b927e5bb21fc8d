"""A discrete-event simulation of the star with M draft servers (a projection, labeled as one).

Each target cycles: it sends a round to its draft server, waits in that
server's queue, is served, and returns after Z (verification plus wire)
with `tokens_per_round` new tokens. A draft server serves its queue in
`fifo` mode one round at a time, or in `batched` mode all queued rounds in
one pass; a pass over b rounds costs pass_cost(b), measured on this machine
(see benchmarks/fabric.py), plus `wake_s` when the server was idle before
it (a round served after an idle gap takes longer: StarSD sees the same).
Targets are assigned with the controller's own rules
(controller/draft_assignment.py); a target no draft server has room for
decodes alone, one token per `plain_step_s`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from controller.draft_assignment import Assignment, DraftSlot, place


@dataclass
class PassCost:
    """Seconds one pass over b rounds takes: linear between measured points, and beyond the last."""

    points: list[tuple[float, float]]  # (rounds in the pass, seconds), at least one

    def __call__(self, b: int) -> float:
        pts = sorted(self.points)
        if len(pts) == 1:
            return pts[0][1]
        k = next((k for k in range(1, len(pts)) if b <= pts[k][0]), len(pts) - 1)  # the segment holding b
        (b0, c0), (b1, c1) = pts[k - 1], pts[k]
        return max(1e-6, c0 + (c1 - c0) * (b - b0) / (b1 - b0)) if b1 != b0 else c1


@dataclass
class StarModel:
    z_s: float  # a target's return time: from drafts received to its next round
    tokens_per_round: float  # accepted drafts + 1, per round
    plain_step_s: float  # a step without drafts (one token)
    cost: PassCost
    mode: str = "fifo"  # fifo | batched
    wake_s: float = 0.0  # extra time of a pass that starts after an idle gap
    n_max: int = 64  # targets per draft server


@dataclass
class _Draft:
    queue: list[int] = field(default_factory=list)
    served: list[int] = field(default_factory=list)  # the rounds of the pass under way
    busy_until: float = 0.0
    busy_s: float = 0.0
    serving: bool = False


def assign(n_targets: int, m_drafts: int, n_max: int) -> dict[str, str | None]:
    slots = [DraftSlot(f"d{j}", "fp", n_max, live=True) for j in range(m_drafts)]
    a = Assignment({f"t{i}": None for i in range(n_targets)})
    place(slots, a, {t: "fp" for t in a.of})
    return a.of


def simulate(model: StarModel, n_targets: int, m_drafts: int, cycles: int = 200) -> dict:
    """System tokens/s and mean draft load over `cycles` unloaded cycles of simulated time."""
    of = assign(n_targets, m_drafts, model.n_max)
    where = [None if of[f"t{i}"] is None else int(of[f"t{i}"][1:]) for i in range(n_targets)]
    drafts = [_Draft() for _ in range(m_drafts)]
    horizon = cycles * (model.z_s + model.cost(1) + model.wake_s)
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, who)
    seq = 0
    tokens = 0.0
    for i, d in enumerate(where):  # targets start spread over one cycle (no synchronized start)
        t0 = model.z_s * i / max(1, n_targets)
        heapq.heappush(events, (t0, seq := seq + 1, "send" if d is not None else "plain", i))
    while events:
        t, _, kind, who = heapq.heappop(events)
        if t > horizon:
            break
        if kind == "plain":
            tokens += 1
            heapq.heappush(events, (t + model.plain_step_s, seq := seq + 1, "plain", who))
        elif kind == "send":
            dr = drafts[where[who]]
            dr.queue.append(who)
            if not dr.serving:
                seq = _start(dr, where[who], t, model, events, seq, idle=True)
        elif kind == "done":
            dr = drafts[who]
            for target in dr.served:
                tokens += model.tokens_per_round
                heapq.heappush(events, (t + model.z_s, seq := seq + 1, "send", target))
            dr.serving = False
            if dr.queue:
                seq = _start(dr, who, t, model, events, seq, idle=False)
    load = [min(1.0, d.busy_s / horizon) for d in drafts]
    return {"system_tokens_per_s": tokens / horizon, "draft_load": sum(load) / len(load) if load else 0.0,
            "without_draft": sum(d is None for d in where)}


def _start(dr: _Draft, index: int, t: float, model: StarModel, events: list, seq: int, idle: bool) -> int:
    """Begin a pass on draft server `index` at time t; returns the event counter."""
    take = dr.queue if model.mode == "batched" else dr.queue[:1]
    dr.served, dr.queue = list(take), dr.queue[len(take):]
    cost = model.cost(len(dr.served)) + (model.wake_s if idle else 0.0)
    dr.serving, dr.busy_s = True, dr.busy_s + cost
    heapq.heappush(events, (t + cost, seq + 1, "done", index))
    return seq + 1


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


def n_full(model: StarModel) -> int:
    """StarSD's N_full for this model's fifo service time."""
    s = model.cost(1)
    return math.ceil(model.z_s / s) + 1 if s > 0 else 1
