"""Lookahead in fanout mode over real gRPC on loopback: besides the chain, the server drafts for the likeliest
rejections (the draft's runner-up as the correction). A round that turns out to be one of them is answered
from its branch with exactly what a server without lookahead answers, and the rounds after it too (the
branch's KV was moved where it belongs)."""

import random
import time

import pytest
import torch
from draft_stream import served, wait_until

from benchmarks.fixtures.reference import hf_greedy
from draft_server import fanout
from draft_server.config import DraftServerConfig
from starjar.errors import InvalidArgument
from starjar.v1 import draft_pb2 as pb

GAMMA = 4
PROMPT = [5, 17, 42, 99, 3, 250, 8, 61]


@pytest.fixture()
def pair(models, monkeypatch):
    """A lookahead-off server and a fanout one, each serving the tiny llama as its draft (a wrong KV or mask
    changes its drafts; the one-layer draft's hardly), every rejection point worth a branch (a tiny random
    model's probabilities are flat) and drafted, and a raw stream on each."""
    monkeypatch.setattr(fanout, "MIN_LIKELIHOOD", 0.0)
    # Every branch drafted whatever the timing (the clock has a test of its own): these tests wait for them.
    monkeypatch.setattr(fanout.BranchClock, "fits", lambda self, seq_id, answered_s: True)
    cfg = dict(max_targets=4, max_gamma=8, max_tokens_per_sequence=512)
    with served(models, models["llama"], [DraftServerConfig(lookahead=m, **cfg) for m in ("off", "fanout")]) as pair:
        yield pair


def _both(streams, gamma=GAMMA, **seq) -> list[int]:
    """One round on both servers: their drafts must be token for token the same."""
    off, fan = (list(s.round(dict(seq_id=1, gamma=gamma, **seq)).sequences[0].tokens) for s in streams)
    assert fan == off and len(off) == gamma
    return off


def _stats(stub) -> pb.DraftStats:
    return stub.GetStats(pb.GetStatsRequest())


def _branches_done(server) -> list:
    """The fanout server's branches for sequence 1, once the chain and every branch are drafted."""
    ahead = server.server.compute.engine.ahead

    def stage():  # staged by the compute thread right after it sent the reply
        return next((s for k, s in list(ahead.stages.items()) if k[1] == 1), None)

    wait_until(lambda: (s := stage()) is not None and s.job.done and all(b.job.done for b in s.branches), 10)
    return stage().branches


@torch.no_grad()
def _runner_up(model, tokens: list[int]) -> int:
    logits = model.model(torch.tensor([tokens])).logits[0, -1]
    return int(torch.topk(logits, 2).indices[1])


def test_likeliest_rejections_weigh_the_drafts_kept_before_the_correction():
    tops = [(0.9, 11, 0.08), (0.5, 12, 0.4), (0.99, 13, 0.01)]
    # Rejections at 0, 1, 2: 0.08, 0.9 * 0.4 = 0.36, 0.9 * 0.5 * 0.01 = 0.0045.
    assert fanout.likeliest_rejections(tops, 2) == [(pytest.approx(0.36), 1, 12), (0.08, 0, 11)]
    assert [p for _, p, _ in fanout.likeliest_rejections(tops, 3)] == [1, 0]  # below MIN_LIKELIHOOD: none


def test_branches_correct_with_the_drafts_runner_up(models, pair):
    servers, streams, _ = pair
    drafts = _both(streams, start=0, tokens=PROMPT)
    branches = _branches_done(servers[1])
    assert len(branches) == fanout.BRANCHES
    for b in branches:
        assert b.token == _runner_up(models["llama"], PROMPT + drafts[:b.point])
        # Its drafts are the draft's greedy continuation after the correction.
        assumed = PROMPT + drafts[:b.point] + [b.token]
        assert b.job.drafts == hf_greedy(models["llama"], assumed, GAMMA)


@pytest.mark.parametrize("which", [0, 1])
def test_a_foreseen_rejection_hits_its_branch_and_answers_what_no_lookahead_answers(models, pair, which):
    servers, streams, stubs = pair
    verified = list(PROMPT)
    drafts = _both(streams, start=0, tokens=verified)
    b = _branches_done(servers[1])[which]
    new = drafts[:b.point] + [b.token]
    drafts = _both(streams, start=len(verified), tokens=new)
    verified += new
    st = _stats(stubs[1])
    assert (st.lookahead_hits, st.lookahead_branch_hits, st.lookahead_misses) == (1, 1, 0)
    # The KV the branch left is what a round drafting after its correction leaves: the next rounds agree.
    for _ in range(3):
        new = drafts[:2] + [7]
        drafts = _both(streams, start=len(verified), tokens=new)
        verified += new
    assert _stats(stubs[0]).lookahead_branch_hits == 0


def test_a_branch_is_pushed_with_the_rejection_it_assumes(models, pair):
    servers, streams, _ = pair
    drafts = _both(streams, start=0, tokens=PROMPT)
    branches = _branches_done(servers[1])
    b = branches[0]
    new = drafts[:b.point] + [b.token]
    nxt = _both(streams, start=len(PROMPT), tokens=new)
    staged = [(st.start, list(st.assumed), list(st.drafts)) for p in streams[1].pushes for st in p.staged]
    assert (len(PROMPT), new, nxt) in staged
    assert len(staged) == 1 + len(branches)  # the chain's push and one per branch


def test_mixed_outcomes_and_gammas_answer_what_no_lookahead_answers(models, pair):
    """Full acceptance, foreseen rejections, unforeseen ones and other gammas in a seeded random order: every
    answer the same as the server without lookahead's, and each kind of outcome met."""
    servers, streams, stubs = pair
    rng = random.Random(3)
    verified = list(PROMPT)
    drafts = _both(streams, start=0, tokens=verified)
    kinds = set()
    for _ in range(14):
        branches = _branches_done(servers[1])
        kind = rng.choice(["chain", "branch", "other"])
        if kind == "chain":
            new = drafts + hf_greedy(models["llama"], verified + drafts, 1)[:1]
        elif kind == "branch":
            b = rng.choice(branches)
            new = drafts[:b.point] + [b.token]
        else:
            k = rng.randrange(len(drafts))
            new = drafts[:k] + [(drafts[k] + 2) % models["llama"].vocab_size]
        kinds.add(kind)
        drafts = _both(streams, gamma=rng.choice([2, GAMMA, GAMMA, 6]), start=len(verified), tokens=new)
        verified += new
    st = _stats(stubs[1])
    assert kinds == {"chain", "branch", "other"}
    assert st.lookahead_branch_hits >= 1 and st.lookahead_hits > st.lookahead_branch_hits and st.lookahead_misses


def test_branches_wait_for_time_the_sequences_rounds_leave():
    clock = fanout.BranchClock()
    answered = time.perf_counter()
    assert clock.fits("s", answered)  # nothing known yet: a branch may start
    clock.passed(0.05)
    clock.returned("s", time.perf_counter() - 0.02)  # its rounds come back in 20 ms: no time for a 50 ms pass
    assert not clock.fits("s", time.perf_counter())
    for _ in range(20):  # they come back in 300 ms from now on
        clock.returned("t", time.perf_counter() - 0.3)
    answered = time.perf_counter()
    assert clock.fits("t", answered)
    assert not clock.fits("t", answered - 0.25)  # 250 ms since the answer: two passes no longer fit
    clock.drop("t")
    assert clock.returns == {"s": pytest.approx(0.02, abs=0.01)}


def test_the_draft_is_argmax_even_among_equal_logits():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, 2.0])  # a tie for the top: argmax takes the first
    token, (p, runner_up, p_runner_up) = fanout.top_two(logits)
    assert (token, runner_up) == (1, 3) and p == pytest.approx(p_runner_up)
    token, (_, runner_up, _) = fanout.top_two(torch.tensor([0.0, 1.0, 5.0, 2.0]))
    assert (token, runner_up) == (2, 3)


def test_branches_run_in_passes_of_their_own(models, pair):
    """A tree row takes every row of its pass off the fast path: no branch shares a pass with a chain."""
    servers, streams, _ = pair
    engine = servers[1].server.compute.engine
    mixed = []
    advance = engine.advance

    def watched(jobs):
        kinds = {j.branch is not None for j in jobs}
        mixed.append(len(kinds) > 1)
        return advance(jobs)

    engine.advance = watched
    streams[1].round(dict(seq_id=1, gamma=GAMMA, start=0, tokens=PROMPT))
    streams[1].round(dict(seq_id=2, gamma=GAMMA, start=0, tokens=PROMPT[::-1]))
    def complete(seq):
        stage = next((s for k, s in list(engine.ahead.stages.items()) if k[1] == seq), None)
        return stage is not None and stage.job.done and all(b.job.done for b in stage.branches)

    for seq in (1, 2):
        wait_until(lambda q=seq: complete(q), timeout=10)
    assert mixed and not any(mixed)


def test_fanout_with_online_adaptation_is_refused():
    from draft_server.tide.config import TideConfig

    with pytest.raises(InvalidArgument, match="adaptation"):
        DraftServerConfig(lookahead="fanout", tide=TideConfig())
