"""The controller's draft servers: M actors, each with its own N_max, and which target speculates with which.

The decisions are draft_assignment's; this module keeps the state they need
(a DraftSlot per draft server, the Assignment) up to date from the
controller's polls and acts on them. The assignment is published the way a
restarted draft server's address always was: a target's draft client asks
the controller (`Controller.draft_address`) before each attach try, now with
its own name, and gets its draft server's address. A target moved while
attached (rebalancing, a draft server retired) is told to ask again
(`TargetWorkerActor.follow_draft`).

Failover does not wait for the poll: a target whose stream broke asks at
once and names the address it lost; the controller tries a TCP connection
there (refused = the process is gone) and, if it is gone, moves every target
of that draft server to live ones with room before Ray has restarted it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from controller.fleet.assignment import Assignment, DraftSlot, Move, place, rebalance
from controller.fleet.names import draft_name

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 0.5
FOLLOW_TIMEOUT_S = 2.0


async def refused(address: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when nothing listens at HOST:PORT any more (connection refused); a slow answer is not proof."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except TimeoutError:  # (an OSError too: caught first) a slow or loaded host is no proof of death
        return False
    except OSError:  # refused, or the host unreachable
        return True
    writer.close()
    return False


class DraftFleet:
    def __init__(self, make_actor, n_max: int, targets: list[str]):
        """make_actor(name) creates (or finds) the draft server actor called `name`."""
        self._make = make_actor
        self.n_max = n_max
        self.handles: dict[str, object] = {}
        self.slots: dict[str, DraftSlot] = {}
        self.assignment = Assignment({t: None for t in targets})
        self.fingerprints: dict[str, str | None] = {t: None for t in targets}
        self.assigned = Counter()  # draft -> targets given to it (any reason)
        self.moves = Counter()  # reason (place, failover, rebalance, retire) -> targets moved
        self.snaps: dict[str, dict] = {}  # draft -> its GetStats snapshot at the last sample

    def add(self, index: int) -> str:
        name = draft_name(index)
        self.handles[name] = self._make(name)
        self.slots[name] = DraftSlot(name, None, self.n_max)
        return name

    def remove(self, name: str) -> None:
        """Forget a retired draft server (its targets have moved already)."""
        self.handles.pop(name, None)
        self.slots.pop(name, None)
        self.snaps.pop(name, None)
        for t, d in self.assignment.of.items():
            if d == name:
                self.assignment.of[t] = None

    def next_index(self) -> int:
        used = {int(n.rsplit("-", 1)[1]) if n[-1].isdigit() else 0 for n in self.handles}
        return next(i for i in range(len(used) + 1) if i not in used)

    def observe(self, info: dict[str, dict], live: dict[str, bool]) -> None:
        """The controller's last poll: which draft servers answer, what tokenizer each serves."""
        for name, slot in self.slots.items():
            slot.live = bool(live.get(name))
            slot.fingerprint = info.get(name, {}).get("fingerprint") or slot.fingerprint
        for t in self.fingerprints:
            self.fingerprints[t] = info.get(t, {}).get("fingerprint") or self.fingerprints[t]

    def address_for(self, target: str, info: dict[str, dict]) -> str | None:
        draft = self.assignment.of.get(target)
        slot = self.slots.get(draft) if draft else None
        return info.get(draft, {}).get("address") if slot is not None and slot.live else None

    def _record(self, moves: list[Move], reason: str) -> None:
        for m in moves:
            self.moves[reason] += 1
            if m.dst is not None:
                self.assigned[m.dst] += 1
            log.info("target %s: draft server %s -> %s (%s)", m.target, m.src or "none", m.dst or "none", reason)

    def settle(self) -> list[Move]:
        """Place every target off a dead or draining server (or off none), then even out the counts. Returns the
        moves of targets that are attached somewhere live and must be told (see follow)."""
        slots = list(self.slots.values())
        placed = place(slots, self.assignment, self.fingerprints)
        self._record([m for m in placed if m.src is None], "place")
        self._record([m for m in placed if m.src is not None and not self.slots[m.src].draining], "failover")
        self._record([m for m in placed if m.src is not None and self.slots[m.src].draining], "retire")
        balanced = rebalance(slots, self.assignment, self.fingerprints)
        self._record(balanced, "rebalance")
        live_src = [m for m in placed if m.src is not None and self.slots[m.src].live]
        return live_src + balanced

    async def follow(self, moves: list[Move], targets: dict[str, object]) -> None:
        """Tell each moved target to ask for its draft server again (it drops its stream to the old one)."""
        calls = [asyncio.wait_for(targets[m.target].follow_draft.remote(), FOLLOW_TIMEOUT_S)
                 for m in moves if m.target in targets]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.info("a moved target did not answer (it asks again when it reattaches): %r", result)

    async def lost(self, target: str, address: str, info: dict[str, dict], live: dict[str, bool]) -> list[Move]:
        """A target lost its stream to `address`: if that is its draft server and nothing listens there any
        more, mark the server down (until the poll sees it again) and move its targets at once. Returns the
        moves of targets attached elsewhere that must be told (settle's)."""
        draft = self.assignment.of.get(target)
        if draft is None or info.get(draft, {}).get("address") != address or not self.slots[draft].live:
            return []
        if not await refused(address):
            return []
        log.warning("%s is gone (connection refused at %s): moving its targets", draft, address)
        live[draft] = False
        self.slots[draft].live = False
        return self.settle()

    async def sample_loads(self) -> dict[str, tuple[dict, dict]]:
        """Each live draft server's busy fraction since the last sample (from GetStats busy and idle time).
        Returns draft server -> (previous, current) GetStats snapshot for those sampled twice (the controller
        estimates N_full and watches saturation per draft server from them)."""
        names = [n for n, s in self.slots.items() if s.live]
        asks = [asyncio.wait_for(self.handles[n].stats.remote(), 4.0) for n in names]
        pairs = {}
        for name, snap in zip(names, await asyncio.gather(*asks, return_exceptions=True), strict=True):
            if isinstance(snap, Exception):
                continue
            busy, idle = float(snap.get("busy_s", 0)), float(snap.get("idle_s", 0))
            prev = self.snaps.get(name)
            self.snaps[name] = snap
            if prev is None:
                continue
            pairs[name] = (prev, snap)
            d_busy, d_idle = busy - float(prev.get("busy_s", 0)), idle - float(prev.get("idle_s", 0))
            if d_busy >= 0 and d_idle >= 0:  # (less than before: it restarted; the next window tells)
                # Neither grew: no round came in the whole window (the loop books its idle gap only when the
                # next round arrives), so it was idle, not "as loaded as last time".
                self.slots[name].load = d_busy / (d_busy + d_idle) if d_busy + d_idle > 0 else 0.0
        return pairs

    def set_n_max(self, n: int) -> None:
        self.n_max = n
        for s in self.slots.values():
            s.n_max = n

    def view(self) -> dict:
        """For status(): each draft server's state, the assignment, the move counts."""
        return {"servers": {n: {"live": s.live, "n_max": s.n_max, "load": round(s.load, 4),
                                "attached": self.assignment.attached(n), "draining": s.draining}
                            for n, s in self.slots.items()},
                "assignment": dict(self.assignment.of), "moves": dict(self.moves),
                "without_draft": self.assignment.unassigned()}

