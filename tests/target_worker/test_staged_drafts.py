"""Drafts pushed ahead are used only by the round they were drafted for, and never pile up."""

from starjar.spec.proposer import DraftRequest
from starjar.v1 import draft_pb2 as pb
from target_worker.remote import staged
from target_worker.remote.staged import StagedDrafts


def _push(seq_id, start, assumed, drafts):
    resp = pb.SpeculateResponse(round_id=0)
    resp.staged.add(seq_id=seq_id, start=start, assumed=assumed, drafts=drafts)
    return resp


def test_only_the_round_a_push_assumed_takes_it_and_only_once():
    box = StagedDrafts()
    box.take_push(_push(7, 10, [4, 5, 6], [8, 9, 1]))
    assert box.replies([DraftRequest("a", 11, [4, 5, 6], 3)], [7]) is None  # another start
    assert box.replies([DraftRequest("a", 10, [4, 5, 2], 3)], [7]) is None  # another outcome
    assert box.replies([DraftRequest("a", 10, [4, 5, 6], 4)], [7]) is None  # more drafts than were pushed
    assert box.replies([DraftRequest("a", 10, [4, 5, 6], 2, 2)], [7]) is None  # a tree
    assert box.replies([DraftRequest("a", 10, [4, 5, 6], 2)], [7]) == [[8, 9]]
    assert box.replies([DraftRequest("a", 10, [4, 5, 6], 2)], [7]) is None  # used up
    assert box.used == 1


def test_a_round_is_answered_from_pushes_only_when_every_sequence_has_one():
    box = StagedDrafts()
    box.take_push(_push(1, 5, [3], [4, 4]))
    two = [DraftRequest("a", 5, [3], 2), DraftRequest("b", 9, [2], 2)]
    assert box.replies(two, [1, 2]) is None
    box.take_push(_push(2, 9, [2], [6, 6]))
    assert box.replies(two, [1, 2]) == [[4, 4], [6, 6]]


def test_pushes_are_bounded_and_dropped_with_their_sequences(monkeypatch):
    monkeypatch.setattr(staged, "MAX_STAGED", 3)
    box = StagedDrafts()
    for w in range(1, 6):  # a faulty server pushing for ids we never sent
        box.take_push(_push(w, 0, [1], [2]))
    assert len(box._by_wire) == 3 and set(box._by_wire) == {3, 4, 5}
    box.drop([4])
    box.clear()
    assert box.replies([DraftRequest("a", 0, [1], 1)], [5]) is None


def test_a_sequence_keeps_one_push_per_outcome_of_one_start(monkeypatch):
    monkeypatch.setattr(staged, "MAX_OUTCOMES", 3)
    box = StagedDrafts()
    box.take_push(_push(7, 10, [4, 5, 6], [8, 9]))  # the chain: full acceptance
    box.take_push(_push(7, 10, [4, 2], [3, 3]))  # fanout: a rejection at the second draft
    box.take_push(_push(7, 10, [4, 2], [3, 1]))  # the same outcome again: replaces its first push
    assert box.replies([DraftRequest("a", 10, [4, 2], 2)], [7]) == [[3, 1]]
    box.take_push(_push(7, 10, [4, 5, 6], [8, 9]))
    for k in range(5):  # a faulty server's many outcomes: the latest few are kept
        box.take_push(_push(7, 10, [k], [k]))
    assert len(box._by_wire[7]) == 3
    assert box.replies([DraftRequest("a", 10, [4], 1)], [7]) == [[4]]
    box.take_push(_push(7, 12, [1], [1]))  # a later start: the earlier start's pushes are stale
    assert box.replies([DraftRequest("a", 10, [3], 1)], [7]) is None
    assert box.replies([DraftRequest("a", 12, [1], 1)], [7]) == [[1]]
