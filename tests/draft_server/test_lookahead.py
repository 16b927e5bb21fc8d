"""Lookahead (chain mode) over real gRPC on loopback: hits answer what a server without lookahead answers, misses
leave the draft's KV as it would have been, and a saturated server never drafts ahead."""

import threading
import time

import grpc
import pytest
from draft_stream import Stream, attach, served, wait_until

from benchmarks.fixtures.reference import hf_greedy
from draft_server import lookahead
from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from starjar.errors import InvalidArgument
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc

GAMMA = 4
PROMPT = [5, 17, 42, 99, 3, 250, 8, 61]


def _config(lookahead: str, **kw) -> DraftServerConfig:
    return DraftServerConfig(max_targets=4, max_gamma=8, max_tokens_per_sequence=512, lookahead=lookahead, **kw)


@pytest.fixture()
def pair(models):
    """A lookahead-off server and a chain one, and a raw stream on each."""
    with served(models, models["draft"], [_config(m) for m in ("off", "chain")]) as pair:
        yield pair


def _both(streams, **seq) -> list[int]:
    """One round on both servers: their drafts must be token for token the same."""
    off, chain = (list(s.round(dict(seq_id=1, gamma=GAMMA, **seq)).sequences[0].tokens) for s in streams)
    assert chain == off and len(off) == GAMMA
    return off


def _stats(stub) -> pb.DraftStats:
    return stub.GetStats(pb.GetStatsRequest())


def _staged(server, drafted: int) -> None:
    """Wait until the chain server has drafted `drafted` tokens ahead (its stages are complete)."""
    wait_until(lambda: server.server.stats.snapshot()["lookahead_drafted_tokens"] >= drafted, timeout=10)


def test_full_acceptance_hits_and_answers_what_no_lookahead_answers(models, pair):
    servers, streams, stubs = pair
    verified = list(PROMPT)
    drafts = _both(streams, start=0, tokens=verified)
    for k in range(1, 7):
        _staged(servers[1], k * (GAMMA + 1))
        # The target accepts everything; its bonus token is the draft's own next token (the draft's guess).
        new = drafts + hf_greedy(models["draft"], verified + drafts, 1)[:1]
        drafts = _both(streams, start=len(verified), tokens=new)
        verified += new
    st, off = _stats(stubs[1]), _stats(stubs[0])
    assert st.lookahead_hits >= 4 and st.lookahead_hits + st.lookahead_misses == 6
    assert st.lookahead_drafted_tokens >= 6 * (GAMMA + 1) and st.lookahead_wasted_tokens <= GAMMA + 1
    # A hit whose stage was complete needed no draft pass: fewer passes than the server without lookahead.
    assert st.draft_steps < off.draft_steps
    assert off.lookahead_hits == off.lookahead_drafted_tokens == 0


@pytest.mark.parametrize("accepted", [0, 2, GAMMA - 1, GAMMA])
def test_a_rejection_is_a_miss_and_answers_what_no_lookahead_answers(models, pair, accepted):
    servers, streams, stubs = pair
    verified = list(PROMPT)
    drafts = _both(streams, start=0, tokens=verified)
    _staged(servers[1], GAMMA + 1)
    # The target keeps `accepted` drafts and then a token the draft did not guess (all four: the bonus differs).
    guess = hf_greedy(models["draft"], verified + drafts, 1)[0]
    choice = drafts[accepted] if accepted < GAMMA else guess
    new = drafts[:accepted] + [(choice + 1) % models["draft"].vocab_size]
    drafts = _both(streams, start=len(verified), tokens=new)
    verified += new
    # The next rounds go on from the rolled-back KV: still the same answers.
    for k in range(2, 4):
        _staged(servers[1], k * (GAMMA + 1))
        new = drafts[:1] + [7]
        drafts = _both(streams, start=len(verified), tokens=new)
        verified += new
    st = _stats(stubs[1])
    assert st.lookahead_misses == 3 and st.lookahead_hits == 0
    assert st.lookahead_wasted_tokens == 3 * (GAMMA + 1)


def test_saturated_server_never_drafts_ahead(models, monkeypatch):
    # fifo and slow passes: while three targets each send their next round as soon as the last is answered,
    # two rounds always wait. Lookahead must not run then; once they stop it does.
    monkeypatch.setenv("STARJAR_DRAFT_FAULTS", "slow_step_ms=25")
    with BackgroundDraftServer(models["draft"], _config("chain", mode="fifo")) as srv:
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        stop, go = threading.Event(), threading.Barrier(3)
        tags = [attach(stub, models, f"t{k}").tag for k in range(3)]

        def target(tag):
            s = Stream(stub, tag)
            verified = list(PROMPT)
            go.wait()
            r = s.round(dict(seq_id=1, start=0, tokens=verified, gamma=GAMMA))
            while not stop.is_set():
                new = list(r.sequences[0].tokens) + [7]
                r = s.round(dict(seq_id=1, start=len(verified), tokens=new, gamma=GAMMA))
                verified += new
            s.close()

        threads = [threading.Thread(target=target, args=(t,)) for t in tags]
        [t.start() for t in threads]
        wait_until(lambda: srv.server.stats.snapshot()["rounds"] >= 24, timeout=60)
        saturated = _stats(stub)
        stop.set()
        [t.join() for t in threads]
        assert saturated.rounds >= 24 and saturated.lookahead_drafted_tokens == 0
        assert saturated.lookahead_hits == saturated.lookahead_misses == 0
        # Idle now: once the recent load has fallen, an answered round is drafted ahead (on a fresh stream: the
        # saturating streams are closed, their sequences gone).
        s = Stream(stub, attach(stub, models, "t9").tag)
        verified, tokens = [], list(PROMPT)
        for _ in range(10):
            r = s.round(dict(seq_id=1, start=len(verified), tokens=tokens, gamma=GAMMA))
            verified += tokens
            time.sleep(0.2)  # the target verifying: the server is idle
            if _stats(stub).lookahead_drafted_tokens > 0:
                break
            tokens = list(r.sequences[0].tokens)[:1] + [7]
        assert _stats(stub).lookahead_drafted_tokens > 0
        s.close()
        ch.close()


def test_lookahead_is_validated():
    with pytest.raises(InvalidArgument, match="lookahead"):
        DraftServerConfig(lookahead="tree")


@pytest.mark.parametrize("gammas", [(2, 4, 4), (6, 3, 4)])
def test_a_hit_asking_another_gamma_answers_what_no_lookahead_answers(models, pair, gammas):
    """Fewer drafts than staged: the KV is cut to what a real round leaves; more: the staged job drafts on."""
    servers, streams, stubs = pair
    verified = list(PROMPT)
    drafts = _both(streams, start=0, tokens=verified)
    drafted = 0
    for gamma in gammas:
        drafted += len(drafts) + 1
        _staged(servers[1], drafted)
        new = drafts + hf_greedy(models["draft"], verified + drafts, 1)[:1]
        off, chain = (list(s.round(dict(seq_id=1, gamma=gamma, start=len(verified), tokens=new)).sequences[0].tokens)
                      for s in streams)
        assert chain == off and len(off) == gamma
        drafts, verified = off, verified + new
    assert _stats(stubs[1]).lookahead_hits >= 2


def _prompt_ahead(servers, streams, stubs) -> list:
    """The prompt sent ahead on both servers (gamma 0: only recorded); once the chain server has fed it and
    drafted its first round ahead, each engine's catch-up count."""
    engines = [s.server.compute.engine for s in servers]
    for s in streams:
        assert list(s.round(dict(seq_id=1, start=0, tokens=PROMPT, gamma=0)).sequences[0].tokens) == []
    wait_until(lambda: _stats(stubs[1]).lookahead_prefilled_tokens == len(PROMPT), timeout=10)
    _staged(servers[1], lookahead.FIRST_GAMMA + 1)  # the ingest's guess and a first round's drafts past it
    assert _stats(stubs[0]).lookahead_prefilled_tokens == 0
    return [e.stats.catchup_tokens for e in engines]


def test_a_prompt_sent_ahead_is_fed_in_idle_time_and_its_first_round_is_staged(models, pair):
    servers, streams, stubs = pair
    before = _prompt_ahead(servers, streams, stubs)
    first = hf_greedy(models["draft"], PROMPT, 1)  # the target's first token, as the served draft guesses it
    _both(streams, start=len(PROMPT), tokens=first)
    fed = [s.server.compute.engine.stats.catchup_tokens - b for s, b in zip(servers, before, strict=True)]
    assert fed == [len(PROMPT) + 1, 0]  # the chain server answered from the stage: nothing left to feed
    assert (_stats(stubs[1]).lookahead_hits, _stats(stubs[1]).lookahead_misses) == (1, 0)


def test_a_first_token_other_than_the_guess_misses_and_finds_the_prompt_in_place(models, pair):
    servers, streams, stubs = pair
    before = _prompt_ahead(servers, streams, stubs)
    other = [hf_greedy(models["draft"], PROMPT, 1)[0] % 50 + 1]  # not the served draft's guess
    _both(streams, start=len(PROMPT), tokens=other)
    fed = [s.server.compute.engine.stats.catchup_tokens - b for s, b in zip(servers, before, strict=True)]
    assert fed == [len(PROMPT) + 1, 1]  # the prompt's KV stays; only the first token is fed
    assert (_stats(stubs[1]).lookahead_hits, _stats(stubs[1]).lookahead_misses) == (0, 1)


def test_only_a_server_that_prefills_ahead_says_so_at_attach(models, pair):
    _, _, stubs = pair
    assert [attach(stub, models, "w2").limits.prefills_ahead for stub in stubs] == [False, True]


def test_a_complete_stage_is_pushed_with_the_outcome_it_assumes(models, pair):
    servers, streams, stubs = pair
    verified = list(PROMPT)
    drafts = _both(streams, start=0, tokens=verified)
    _staged(servers[1], GAMMA + 1)
    guess = hf_greedy(models["draft"], verified + drafts, 1)[0]
    new = drafts + [guess]
    nxt = _both(streams, start=len(verified), tokens=new)  # full acceptance and the guessed bonus: a hit
    assert streams[0].pushes == []  # no lookahead, no push
    push = streams[1].pushes[-1]
    assert push.round_id == 0 and not push.sequences and len(push.staged) == 1
    st = push.staged[0]
    assert (st.seq_id, st.start, list(st.assumed), list(st.drafts)) == (1, len(verified), new, nxt)
