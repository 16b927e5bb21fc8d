"""Which draft server each target speculates with: pure decisions, no Ray, no gRPC (the controller acts on them).

A target goes to a draft server that serves its tokenizer (same fingerprint),
is live, and has room under its own N_max; among those, the least loaded:
attached fraction of N_max plus measured busy fraction (see score). A target
no draft server can take is unassigned and decodes without drafts, exactly
as a target refused at admission does today.

Failover moves a dead draft server's targets at once to live ones with room;
rebalancing, when a draft server returns or one is added, moves targets from
the most to the least attached until the counts differ by at most one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DraftSlot:
    name: str
    fingerprint: str | None  # the tokenizer fingerprint its model has; None = not known yet (not started)
    n_max: int  # targets it may serve at once
    live: bool = False
    load: float = 0.0  # measured busy fraction over the last window (0 until measured)
    draining: bool = False  # being retired: keeps its targets until they are moved, takes no new ones


@dataclass(frozen=True)
class Move:
    target: str
    src: str | None  # None: the target had no draft server
    dst: str | None  # None: no draft server can take it; it decodes without drafts


@dataclass
class Assignment:
    """target name -> draft server name (or None), with the counts the decisions need."""

    of: dict[str, str | None] = field(default_factory=dict)

    def attached(self, draft: str) -> list[str]:
        return sorted(t for t, d in self.of.items() if d == draft)

    def count(self, draft: str) -> int:
        return sum(1 for d in self.of.values() if d == draft)

    def unassigned(self) -> list[str]:
        return sorted(t for t, d in self.of.items() if d is None)

    def apply(self, moves: list[Move]) -> None:
        for m in moves:
            self.of[m.target] = m.dst


def _usable(slot: DraftSlot, fingerprint: str | None) -> bool:
    return slot.live and not slot.draining and (fingerprint is None or slot.fingerprint == fingerprint)


def score(slot: DraftSlot, count: int) -> float:
    """How loaded a draft server is for a newcomer: its attached fraction of N_max (exact, immediate) plus its
    measured busy fraction (a slower server, or one with busier targets, is measured higher; 0 until measured)."""
    return count / max(1, slot.n_max) + slot.load


def pick(slots: list[DraftSlot], assignment: Assignment, fingerprint: str | None,
         exclude: tuple[str, ...] = (), counts: Counter | None = None) -> str | None:
    """The draft server a target with this fingerprint should join now, or None when none has room.
    `counts`: targets per draft server, when the caller keeps them (place() does, for thousands of targets)."""
    counts = Counter(assignment.of.values()) if counts is None else counts
    best, best_key = None, None
    for s in slots:
        n = counts[s.name]
        if s.name in exclude or not _usable(s, fingerprint) or n >= s.n_max:
            continue
        key = (score(s, n), n, s.name)
        if best_key is None or key < best_key:
            best, best_key = s.name, key
    return best


def place(slots: list[DraftSlot], assignment: Assignment, fingerprints: dict[str, str | None]) -> list[Move]:
    """Moves that take every target off a dead, draining or unknown draft server (or off none) onto a live one
    with room; a target no live one can take is left (or put) without a draft server. Applied as it goes."""
    names = {s.name: s for s in slots}
    counts = Counter(assignment.of.values())
    moves = []
    for target in sorted(assignment.of):
        cur = assignment.of[target]
        slot = names.get(cur) if cur is not None else None
        if slot is not None and slot.live and not slot.draining:
            continue
        dst = pick(slots, assignment, fingerprints.get(target), exclude=(cur,) if cur else (), counts=counts)
        if dst != cur:
            move = Move(target, cur, dst)
            assignment.apply([move])
            counts[cur] -= 1
            counts[dst] += 1
            moves.append(move)
    return moves


def rebalance(slots: list[DraftSlot], assignment: Assignment, fingerprints: dict[str, str | None]) -> list[Move]:
    """Moves from the most attached live draft server to the least until the counts (as fractions of N_max)
    are within one target; a target moves only to a server that serves its tokenizer. Applied as it goes."""
    moves: list[Move] = []
    live = [s for s in slots if _usable(s, None)]
    for _ in range(sum(s.n_max for s in live)):  # bounded: each move narrows the spread
        if len(live) < 2:
            break
        by_fill = sorted(live, key=lambda s: (assignment.count(s.name) / max(1, s.n_max), s.name))
        low, high = by_fill[0], by_fill[-1]
        n_low, n_high = assignment.count(low.name), assignment.count(high.name)
        if n_high - n_low <= 1 or n_low >= low.n_max:
            break
        movable = [t for t in assignment.attached(high.name) if fingerprints.get(t) in (None, low.fingerprint)]
        if not movable:
            break
        move = Move(movable[-1], high.name, low.name)
        assignment.apply([move])
        moves.append(move)
    return moves


def capacity(slots: list[DraftSlot], exclude: tuple[str, ...] = ()) -> int:
    """Targets the live draft servers (but `exclude`) can serve together."""
    return sum(s.n_max for s in slots if _usable(s, None) and s.name not in exclude)
