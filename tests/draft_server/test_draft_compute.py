"""The compute loop's scheduling: per-pass (iteration-level) batching, one job per sequence, deferred releases.

A real engine on a tiny draft; the only hook is a wrapper that enqueues work at a chosen pass, so what
arrives "mid-way" is exact instead of timed.
"""

import threading

import pytest

from benchmarks.fixtures.reference import hf_greedy
from draft_server.compute import ComputeLoop
from draft_server.engine import DraftEngine
from draft_server.stats import ServerStats
from draft_server.work_queue import ReleaseWork, RoundWork, make_queue
from starjar.spec.proposer import DraftRequest


class Replies:
    def __init__(self):
        self.order, self.got, self.cv = [], {}, threading.Condition()

    def __call__(self, work, replies, wait_s, compute_s, n):
        with self.cv:
            self.order.append(work.round_id)
            self.got[work.round_id] = replies
            self.cv.notify_all()

    def wait(self, n):
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.order) >= n, timeout=60)


def run_loop(models, mode, at_pass):
    """Start a loop whose engine calls at_pass[k]() just before its k-th pass (1-based)."""
    engine = DraftEngine(models["draft"])
    passes = [0]
    advance = engine.advance

    def hooked(jobs):
        passes[0] += 1
        if passes[0] in at_pass:
            at_pass[passes[0]]()
        advance(jobs)

    engine.advance = hooked
    queue = make_queue(mode, 64)
    loop = ComputeLoop(engine, queue, ServerStats(), mode=mode)
    loop.start()
    return engine, queue, loop


def rnd(reply, round_id, seq, start, tokens, gamma, worker="t"):
    return RoundWork(b"tag", worker, round_id, [DraftRequest((b"tag", seq), start, tokens, gamma)], reply)


@pytest.mark.parametrize("mode,order", [("batched", [2, 1]), ("fifo", [1, 2])])
def test_a_round_arriving_mid_way_joins_the_next_pass_in_batched_mode(models, mode, order):
    """Round 2 (one pass) comes during round 1's first pass (eight passes). Batched: it joins the next pass and
    is answered while round 1 still drafts. Fifo: it waits for round 1, as in StarSD."""
    replies = Replies()
    late = rnd(replies, 2, 2, 0, [7, 8], 1)
    _, queue, loop = run_loop(models, mode, {1: lambda: queue.put(late)})
    queue.put(rnd(replies, 1, 1, 0, [5, 6, 7], 8))
    replies.wait(2)
    assert replies.order == order
    d = models["draft"]
    assert replies.got[1] == [hf_greedy(d, [5, 6, 7], 8)[:8]]
    assert replies.got[2] == [hf_greedy(d, [7, 8], 1)[:1]]
    queue.close()
    loop.join(10)


@pytest.mark.parametrize("cap,order", [(64, [3, 1, 2]), (2, [1, 2, 3])])
def test_the_batch_cap_keeps_rounds_past_it_waiting_for_a_place(models, cap, order):
    """Three rounds are queued at once: two of four drafts, then one of a single draft. Uncapped, all three share
    the first pass and the short one is answered first; with max_batch_rounds=2 it waits until both long
    rounds are done (`serve draft --max-batch-rounds`)."""
    replies = Replies()
    queue = make_queue("batched", cap)
    for round_id, seq, gamma in ((1, 1, 4), (2, 2, 4), (3, 3, 1)):
        queue.put(rnd(replies, round_id, seq, 0, [5 + seq, 6, 7], gamma))
    loop = ComputeLoop(DraftEngine(models["draft"]), queue, ServerStats(), mode="batched", max_batch_rounds=cap)
    loop.start()
    replies.wait(3)
    assert replies.order == order
    assert replies.got[3] == [hf_greedy(models["draft"], [8, 6, 7], 1)[:1]]
    queue.close()
    loop.join(10)


def test_a_sequence_has_one_job_at_a_time_and_its_release_waits(models):
    replies = Replies()
    freed = []
    d = models["draft"]
    first = hf_greedy(d, [5, 6, 7], 6)[:6]
    # While round 1 of sequence 1 drafts, the target (past its deadline) sends round 2 of the same sequence
    # and then ends it: round 2 waits for round 1, and the release waits for round 2.
    again = rnd(replies, 2, 1, 3, [first[0], 11], 2)
    engine, queue, loop = run_loop(models, "batched", {
        2: lambda: (queue.put(again), queue.put(ReleaseWork([(b"tag", 1)], done=freed.append)))})
    queue.put(rnd(replies, 1, 1, 0, [5, 6, 7], 6))
    replies.wait(2)
    assert replies.order == [1, 2]
    assert replies.got[1] == [first]
    assert replies.got[2] == [hf_greedy(d, [5, 6, 7, first[0], 11], 2)[:2]]
    queue.close()
    loop.join(10)
    assert freed == [1] and engine.num_sequences == 0


def test_a_failed_pass_answers_resync_and_drops_the_sequences(models):
    replies = Replies()

    def boom():
        raise RuntimeError("injected")

    engine, queue, loop = run_loop(models, "batched", {1: boom})
    queue.put(rnd(replies, 1, 1, 0, [5, 6, 7], 3))
    replies.wait(1)
    assert replies.got[1] == [None] and engine.num_sequences == 0
    queue.put(rnd(replies, 2, 1, 0, [5, 6, 7], 3))  # resent from position 0: drafts again
    replies.wait(2)
    assert replies.got[2] == [hf_greedy(models["draft"], [5, 6, 7], 3)[:3]]
    queue.close()
    loop.join(10)
