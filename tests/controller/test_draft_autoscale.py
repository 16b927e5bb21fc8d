"""When the controller adds and retires draft servers (controller/fleet/autoscale.py)."""

from __future__ import annotations

import pytest

from controller.fleet.assignment import Assignment, DraftSlot, place
from controller.fleet.autoscale import decide, parse_range
from starjar.errors import InvalidArgument

FP = "fp"


def _state(n_targets: int, n_max: int, loads: list[float]) -> tuple[list[DraftSlot], Assignment]:
    slots = [DraftSlot(f"d{i}", FP, n_max, live=True, load=x) for i, x in enumerate(loads)]
    a = Assignment({f"t{i}": None for i in range(n_targets)})
    place(slots, a, {t: FP for t in a.of})
    return slots, a


def test_range_is_parsed_and_checked():
    assert parse_range("1..4") == (1, 4) and parse_range("2") == (2, 2)
    for bad in ("4..1", "0..2", "a..b", "1..99"):
        with pytest.raises(InvalidArgument, match="--autoscale-drafts"):
            parse_range(bad)


def test_adds_when_targets_wait_and_every_server_is_at_n_max():
    slots, a = _state(6, 2, [0.5, 0.5])
    assert a.unassigned() and decide(slots, a, 1, 4).action == "add"
    assert decide(slots, a, 1, 2) is None  # at MAX


def test_adds_when_every_server_is_saturated():
    slots, a = _state(4, 8, [0.98, 0.99])
    assert not a.unassigned() and decide(slots, a, 1, 3).action == "add"
    slots[1].load = 0.8
    assert decide(slots, a, 1, 3) is None


def test_waits_while_a_new_server_starts():
    slots, a = _state(6, 2, [0.5])
    slots.append(DraftSlot("d1", None, 2))  # added, not serving yet
    assert decide(slots, a, 1, 4) is None


def test_retires_the_least_attached_when_the_others_carry_its_targets():
    slots, a = _state(4, 8, [0.3, 0.1, 0.2])
    assert [a.count(s.name) for s in slots] == [1, 2, 1]
    d = decide(slots, a, 1, 4)
    assert d.action == "retire" and d.draft == "d2"  # fewest targets (1), lowest load
    assert decide(slots, a, 3, 4) is None  # at MIN
    assert decide(slots, a, 1, 4, keep=("d2", "d1", "d0")) is None
    busy, b = _state(4, 8, [0.7, 0.7, 0.5])
    assert decide(busy, b, 1, 4) is None  # the others would run at 0.95: too hot
    small, c = _state(6, 2, [0.1, 0.1, 0.1])
    assert decide(small, c, 1, 4) is None  # no room under N_max for its targets
