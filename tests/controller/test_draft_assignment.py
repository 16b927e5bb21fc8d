"""Which draft server each target speculates with (controller/fleet/assignment.py, pure logic)."""

from __future__ import annotations

from controller.fleet.assignment import Assignment, DraftSlot, Move, capacity, pick, place, rebalance

FP = "32000:abc"


def _slots(*n_max: int, live: bool = True) -> list[DraftSlot]:
    return [DraftSlot(f"d{i}", FP, n, live=live) for i, n in enumerate(n_max)]


def _assign(n_targets: int, slots: list[DraftSlot]) -> Assignment:
    a = Assignment({f"t{i}": None for i in range(n_targets)})
    place(slots, a, {t: FP for t in a.of})
    return a


def test_targets_spread_evenly_and_never_past_n_max():
    slots = _slots(3, 3)
    a = _assign(8, slots)
    assert a.count("d0") == 3 and a.count("d1") == 3
    assert len(a.unassigned()) == 2  # no room: they decode without drafts


def test_least_loaded_by_measured_load():
    slots = _slots(8, 8)
    a = Assignment({"t0": "d0", "t1": "d1", "new": None})
    slots[0].load, slots[1].load = 0.9, 0.2  # d0 is slower per target (a weaker node)
    assert pick(slots, a, FP) == "d1"
    slots[0].load, slots[1].load = 0.1, 0.6
    assert pick(slots, a, FP) == "d0"


def test_tokenizer_fingerprint_must_match():
    slots = [DraftSlot("llama", "32000:aaa", 4, live=True), DraftSlot("qwen", "151936:bbb", 4, live=True)]
    a = Assignment({"t": None})
    assert pick(slots, a, "151936:bbb") == "qwen"
    assert pick(slots, a, "50257:ccc") is None


def test_failover_moves_a_dead_servers_targets_at_once_and_keeps_the_others():
    slots = _slots(4, 4)
    a = _assign(4, slots)
    before = dict(a.of)
    slots[0].live = False
    moves = place(slots, a, {t: FP for t in a.of})
    moved = {m.target for m in moves}
    assert moved == {t for t, d in before.items() if d == "d0"}
    assert all(m.dst == "d1" for m in moves) and a.count("d1") == 4
    assert all(a.of[t] == d for t, d in before.items() if d == "d1")


def test_failover_without_room_leaves_targets_without_a_draft_server():
    slots = _slots(2, 2)
    a = _assign(4, slots)
    slots[1].live = False
    moves = place(slots, a, {t: FP for t in a.of})
    assert {m.dst for m in moves} == {None} and len(moves) == 2 and a.count("d0") == 2
    slots[1].live = True  # it returns: the targets without one get it
    back = place(slots, a, {t: FP for t in a.of})
    assert len(back) == 2 and a.count("d1") == 2 and not a.unassigned()


def test_rebalance_when_a_server_returns():
    slots = _slots(4, 4)
    a = _assign(4, slots)
    slots[0].live = False
    place(slots, a, {t: FP for t in a.of})
    assert a.count("d1") == 4
    slots[0].live = True
    assert place(slots, a, {t: FP for t in a.of}) == []  # every target has a live server already
    moves = rebalance(slots, a, {t: FP for t in a.of})
    assert len(moves) == 2 and all(m == Move(m.target, "d1", "d0") for m in moves)
    assert a.count("d0") == 2 and a.count("d1") == 2
    assert rebalance(slots, a, {t: FP for t in a.of}) == []  # balanced: nothing more moves


def test_draining_server_takes_nothing_and_is_emptied():
    slots = _slots(4, 4, 4)
    a = _assign(6, slots)
    slots[2].draining = True
    assert capacity(slots) == 8
    moves = place(slots, a, {t: FP for t in a.of})
    assert len(moves) == 2 and a.count("d2") == 0 and a.count("d0") + a.count("d1") == 6
    assert rebalance(slots, a, {t: FP for t in a.of}) == []
