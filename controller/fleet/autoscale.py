"""`--autoscale-drafts MIN..MAX`: when to add a draft server and when to retire one.

Add one (up to MAX) when targets wait for speculation and the draft servers
cannot take them: a target has no draft server and every live one is at its
N_max, or every live one is saturated (measured load >= 0.97) while serving
more than one target. Retire one (down to MIN) when the others can carry its
targets: they have room under N_max and their measured load, with its load
spread over them, stays under RETIRE_LOAD. Retiring drains first (its
targets move to the others, as in a rebalance), then stops the server. One
action per COOLDOWN_S, so a decision is judged on load measured after the
last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from controller.fleet.assignment import Assignment, DraftSlot, capacity
from starjar.errors import InvalidArgument

log = logging.getLogger(__name__)
SATURATED = 0.97
RETIRE_LOAD = 0.6
COOLDOWN_S = 10.0


def parse_range(text: str) -> tuple[int, int]:
    """"1..4" -> (1, 4)."""
    lo, sep, hi = text.partition("..")
    try:
        bounds = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise InvalidArgument("--autoscale-drafts", "MIN..MAX with integers, e.g. 1..4", text) from None
    if not 1 <= bounds[0] <= bounds[1] <= 64:
        raise InvalidArgument("--autoscale-drafts", "1 <= MIN <= MAX <= 64", text)
    return bounds


@dataclass(frozen=True)
class Decision:
    action: str  # "add" | "retire"
    draft: str | None = None  # the one to retire
    why: str = ""


def decide(slots: list[DraftSlot], assignment: Assignment, lo: int, hi: int,
           keep: tuple[str, ...] = ()) -> Decision | None:
    """The next scaling step, or None. Counts draft servers that are live or starting (not draining); never
    retires one named in `keep`."""
    active = [s for s in slots if not s.draining]
    live = [s for s in active if s.live]
    if len(live) < len(active):
        return None  # one is starting (or restarting): judge after it serves
    full = all(assignment.count(s.name) >= s.n_max for s in live)
    waiting = assignment.unassigned()
    if len(active) < hi and waiting and full:
        return Decision("add", why=f"{len(waiting)} target(s) without a draft server, every one at N_max")
    saturated = live and all(s.load >= SATURATED and assignment.count(s.name) > 1 for s in live)
    if len(active) < hi and saturated:
        return Decision("add", why="every draft server saturated (load >= 0.97)")
    if len(live) <= max(1, lo) or waiting:
        return None
    candidates = [s for s in live if s.name not in keep]
    if not candidates:
        return None
    victim = min(candidates, key=lambda s: (assignment.count(s.name), s.load, [-ord(c) for c in s.name]))
    rest = [s for s in live if s is not victim]
    moved = assignment.count(victim.name)
    room = capacity(rest) - sum(assignment.count(s.name) for s in rest)
    load_after = (sum(s.load for s in rest) + victim.load) / len(rest)
    if room >= moved and load_after < RETIRE_LOAD:
        return Decision("retire", victim.name, f"the others carry its {moved} target(s) at load {load_after:.2f}")
    return None


class Autoscaler:
    """Acts on decide() for a DraftFleet: adds through the fleet, retires by draining, then `stop(name, handle)`."""

    def __init__(self, lo: int, hi: int, stop: Callable[[str, object], Awaitable[None]],
                 cooldown_s: float = COOLDOWN_S, clock: Callable[[], float] = time.monotonic,
                 keep: tuple[str, ...] = ()):
        self.lo, self.hi, self._stop, self.cooldown_s, self.clock = lo, hi, stop, cooldown_s, clock
        self.keep = keep  # never retired (none in the controller: N_full and the guard watch every server)
        self._last = -float("inf")
        self.added = 0
        self.retired = 0

    async def step(self, fleet) -> Decision | None:
        """Finish retirements whose targets have all moved; then maybe one new step (see decide)."""
        for name, slot in list(fleet.slots.items()):
            if slot.draining and fleet.assignment.count(name) == 0:
                log.info("%s drained: stopping it", name)
                await self._stop(name, fleet.handles[name])
                fleet.remove(name)
                self.retired += 1
        if self.clock() - self._last < self.cooldown_s:
            return None
        d = decide(list(fleet.slots.values()), fleet.assignment, self.lo, self.hi, self.keep)
        if d is None:
            return None
        self._last = self.clock()
        if d.action == "add":
            name = fleet.add(fleet.next_index())
            self.added += 1
            log.info("autoscale: adding %s (%s)", name, d.why)
        else:
            fleet.slots[d.draft].draining = True  # settle() moves its targets off, reason "retire"
            log.info("autoscale: retiring %s (%s)", d.draft, d.why)
        return d
