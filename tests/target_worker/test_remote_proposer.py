"""Target engines drafting through a real draft server: exact output whatever the draft side does."""

import threading
import time

import grpc

from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from starjar.spec.policy import FixedGamma
from starjar.spec.proposer import DraftRequest
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer

GREEDY = SamplingParams(max_tokens=48)


def engine_for(models, address, worker, gamma=3, deadline_s=2.0, batch=8):
    rp = RemoteProposer(address, models["llama"].fingerprint, worker, deadline_s, backoff_s=(0.02, 0.2))
    return TargetEngine(models["llama"], rp, FixedGamma(gamma), EngineConfig(max_batch_size=batch)), rp


def test_three_targets_share_one_draft_server(models, prompt_ids, reference):
    ref = reference("llama", 48)
    with BackgroundDraftServer(models["draft"]) as srv:
        results = {}

        def run(k):
            eng, rp = engine_for(models, srv.address, f"t{k}")
            assert rp.wait_attached(10)
            reqs = eng.generate(prompt_ids, GREEDY)
            results[k] = ([r.output_ids for r in reqs], eng.stats, rp.stats)
            rp.close()

        threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for outs, es, cs in results.values():
            assert outs == ref
            assert es.accepted_tokens > 0 and cs.rounds > 0 and not cs.fallbacks
        stats = srv.server.stats.snapshot()
        assert stats["rounds"] == sum(cs.rounds for _, _, cs in results.values())
        assert stats["per_worker"] == {}  # each target's figures went with its detach
        time.sleep(0.2)
        assert srv.server.compute.engine.num_sequences == 0  # released as requests finished


def test_refused_at_n_max_runs_without_speculation(models, prompt_ids, reference):
    with BackgroundDraftServer(models["draft"], DraftServerConfig(max_targets=1)) as srv:
        first, rp1 = engine_for(models, srv.address, "first")
        assert rp1.wait_attached(10)
        second, rp2 = engine_for(models, srv.address, "second")
        outs = second.generate(prompt_ids[:10], GREEDY)
        assert [r.output_ids for r in outs] == reference("llama", 48)[:10]
        assert rp2.stats.refusals["admission"] >= 1 and second.stats.drafted_tokens == 0
        assert second.stats.proposer_failures > 0
        rp1.close(), rp2.close()


def test_missed_deadlines_fall_back(models, prompt_ids, reference):
    with BackgroundDraftServer(models["draft"]) as srv:
        eng, rp = engine_for(models, srv.address, "slowpoke", deadline_s=1e-6)
        assert rp.wait_attached(10)
        outs = eng.generate(prompt_ids[:8], GREEDY)
        assert [r.output_ids for r in outs] == reference("llama", 48)[:8]
        assert rp.stats.fallbacks["deadline"] > 0
        rp.close()


def test_draft_server_restart_mid_run(models, prompt_ids, reference):
    """The server goes away and comes back on the same port: no request fails or changes."""
    srv = BackgroundDraftServer(models["draft"]).start()
    port = srv.server.port
    eng, rp = engine_for(models, srv.address, "survivor", batch=4)
    assert rp.wait_attached(10)
    reqs = [eng.add_request(p, GREEDY) for p in prompt_ids[:12]]
    steps = 0
    restarted = None
    while eng.has_work():
        eng.step()
        steps += 1
        if steps == 10:
            srv.stop(grace=0)
        if steps == 25:
            restarted = BackgroundDraftServer(models["draft"], DraftServerConfig(port=port)).start()
        if steps > 25:
            time.sleep(0.02)  # give the client real time to reattach while requests are running
    assert [r.output_ids for r in reqs] == reference("llama", 48)[:12]
    assert restarted is not None and rp.wait_attached(10) and rp.stats.attaches >= 2
    assert eng.stats.proposer_failures > 0
    rounds_before = rp.stats.rounds
    again = eng.generate(prompt_ids[:4], GREEDY)  # and it speculates again
    assert [r.output_ids for r in again] == reference("llama", 48)[:4] and rp.stats.rounds > rounds_before
    rp.close()
    if restarted:
        restarted.stop(grace=0)


class MalformedDraftService(pb_grpc.DraftServiceServicer):
    """Fault injection: a draft server that answers with the wrong sequence ids and bogus tokens."""

    def Attach(self, request, context):
        return pb.AttachResponse(tag=b"x" * 16, limits=pb.Limits(max_gamma=8))

    def Speculate(self, request_iterator, context):
        for req in request_iterator:
            resp = pb.SpeculateResponse(round_id=req.round_id)
            for s in req.sequences:
                resp.sequences.add(seq_id=s.seq_id + (req.round_id % 2), tokens=[10**6] * s.gamma)
            yield resp


def test_malformed_replies_fall_back(models, prompt_ids, reference):
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_DraftServiceServicer_to_server(MalformedDraftService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        eng, rp = engine_for(models, f"127.0.0.1:{port}", "victim")
        assert rp.wait_attached(10)
        outs = eng.generate(prompt_ids[:6], GREEDY)
        assert [r.output_ids for r in outs] == reference("llama", 48)[:6]
        assert rp.stats.fallbacks["malformed"] > 0 and eng.stats.proposer_failures > 0
        rp.close()
    finally:
        server.stop(0)


def test_two_requests_with_one_id_keep_their_own_draft_sessions(models, prompt_ids, reference):
    """Draft state is keyed by an internal id, not the caller's request_id."""
    ref = reference("llama", 48)
    with BackgroundDraftServer(models["draft"]) as srv:
        eng, rp = engine_for(models, srv.address, "dup")
        assert rp.wait_attached(10)
        reqs = [eng.add_request(p, GREEDY, request_id="same-id") for p in prompt_ids[:4]]
        while eng.has_work():
            eng.step()
        assert [r.output_ids for r in reqs] == ref[:4]
        assert rp.stats.attaches == 1 and not rp.stats.fallbacks  # no broken stream, no resync
        assert eng.stats.accepted_tokens > 0
        rp.close()


def test_the_client_clamps_to_the_servers_advertised_limits(models, prompt_ids, reference):
    """A target asking gamma 5 of a server that allows 2 drafts 2, with no resync or fallback."""
    with BackgroundDraftServer(models["draft"], DraftServerConfig(max_gamma=2)) as srv:
        eng, rp = engine_for(models, srv.address, "clamp", gamma=5)
        assert rp.wait_attached(10) and rp.limits.max_gamma == 2
        reqs = eng.generate(prompt_ids[:4], GREEDY)
        assert [r.output_ids for r in reqs] == reference("llama", 48)[:4]
        assert not rp.stats.fallbacks and rp.stats.attaches == 1
        assert eng.stats.drafted_tokens <= 2 * eng.stats.spec_rounds and eng.stats.accepted_tokens > 0
        assert srv.server.stats.snapshot()["bad_sequences"] == 0
        rp.close()


def test_close_ends_the_proposers_own_threads(models, prompt_ids, reference):
    """Each proposer drives its stream from an event loop thread of its own: close() ends that loop and the
    attach thread, and a closed proposer answers every step without drafts (never hangs)."""
    from starjar.spec.proposer import DraftRequest
    from target_worker.remote.client import DraftUnavailable

    with BackgroundDraftServer(models["draft"]) as srv:
        before = set(threading.enumerate())
        pairs = [engine_for(models, srv.address, f"closer{k}", batch=2) for k in range(3)]
        assert all(rp.wait_attached(10) for _, rp in pairs)
        eng, rp = pairs[0]
        outs = eng.generate(prompt_ids[:2], GREEDY)
        assert [r.output_ids for r in outs] == reference("llama", 48)[:2] and rp.stats.rounds > 0
        assert {t.name for t in set(threading.enumerate()) - before} >= {"draft-wire", "draft-attach"}
        for _, p in pairs:
            p.close()
        deadline = time.time() + 5
        while set(threading.enumerate()) - before and time.time() < deadline:
            time.sleep(0.05)
        assert not set(threading.enumerate()) - before
        t0 = time.perf_counter()
        try:
            rp.propose([DraftRequest("x", 0, [5, 6, 7], 2)])
            raise AssertionError("a closed proposer proposed")
        except DraftUnavailable as exc:
            assert exc.reason == "detached"
        assert time.perf_counter() - t0 < 0.1


def test_a_round_finishing_after_its_target_left_is_not_kept_for_it(models, prompt_ids, monkeypatch):
    """Per-target figures are bounded by the targets attached: a round still drafting when its target detaches
    is not counted for that target again (before, each such round re-created the forgotten entry)."""
    from starjar.spec.proposer import DraftRequest
    from target_worker.remote.client import DraftUnavailable

    monkeypatch.setenv("STARJAR_DRAFT_FAULTS", "slow_step_ms=100")  # a gamma-8 round takes about a second
    with BackgroundDraftServer(models["draft"]) as srv:
        for k in range(3):
            rp = RemoteProposer(srv.address, models["llama"].fingerprint, f"gone-{k}", 0.05, backoff_s=(0.02, 0.2))
            assert rp.wait_attached(10)
            try:
                rp.propose([DraftRequest(1, 0, list(prompt_ids[k]), 8)])
            except DraftUnavailable:
                pass  # the deadline: the round drafts on without anyone waiting
            rp.close()  # detached while its round is in flight
        deadline = time.monotonic() + 20
        while srv.server.stats.snapshot()["rounds"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = srv.server.stats.snapshot()
    assert stats["rounds"] == 3  # the rounds finished after their targets left
    assert stats["per_worker"] == {}


def test_lookahead_chain_keeps_the_output_the_targets_alone(models, prompt_ids, reference):
    # The target's own model as the draft: every draft is accepted and the bonus token is the draft's guess,
    # so rounds hit the staged drafts; the tiny draft misses mostly. The output is the target's either way.
    ref = reference("llama", 48)[:6]
    for draft in ("llama", "draft"):
        cfg = DraftServerConfig(lookahead="chain")
        with BackgroundDraftServer(models[draft], cfg) as srv:
            eng, rp = engine_for(models, srv.address, "t", gamma=4, batch=2)
            eng.send_ahead = rp.send_ahead  # new prompts go to the draft before the target prefills them
            assert rp.wait_attached(10)
            outs = [r.output_ids for r in eng.generate(prompt_ids[:6], GREEDY)]
            rp.close()
            stats = srv.server.stats.snapshot()
        assert outs == ref, draft
        assert stats["lookahead_hits"] + stats["lookahead_misses"] > 0, draft
        assert stats["lookahead_prefilled_tokens"] > 0, draft
        if draft == "llama":
            assert stats["lookahead_hits"] > 0


def test_a_server_without_lookahead_is_sent_no_prompt_ahead(models, prompt_ids, reference):
    with BackgroundDraftServer(models["draft"]) as srv:
        eng, rp = engine_for(models, srv.address, "t", gamma=3, batch=2)
        eng.send_ahead = rp.send_ahead
        assert rp.wait_attached(10)
        assert rp.send_ahead([DraftRequest("x", 0, prompt_ids[0], 0)]) == [False]
        outs = [r.output_ids for r in eng.generate(prompt_ids[:4], GREEDY)]
        rp.close()
        rounds = srv.server.stats.snapshot()["rounds"]
    assert outs == reference("llama", 48)[:4] and rounds > 0


def test_prompts_of_requests_that_ended_at_prefill_do_not_hold_later_ones_back(models, prompt_ids):
    # A request that ends with its first token never has a real round, so its send-ahead's answer is read by
    # nobody's round: later prompts must go ahead all the same (before, the third one of a run was not sent
    # and its draft prefilled on the first round's critical path).
    with BackgroundDraftServer(models["draft"], DraftServerConfig(lookahead="chain")) as srv:
        eng, rp = engine_for(models, srv.address, "t", gamma=3, batch=1)
        assert rp.wait_attached(10)
        went = []

        def send_ahead(requests):
            went.extend(rp.send_ahead(requests))
            time.sleep(0.05)  # the server's answer arrives before the next prompt
            return went[-len(requests):]

        eng.send_ahead = send_ahead
        for ids in prompt_ids[:5]:
            eng.generate([ids], SamplingParams(max_tokens=1))
        rp.close()
    assert went == [True] * 5


def test_seeded_sampling_through_lookahead_repeats_the_target_alone(models, prompt_ids):
    # A seeded draw depends on its position alone, so whatever was drafted ahead, hit or missed, the tokens are
    # the target's own: the same as the target decoding alone with the same seeds.
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=100 + i) for i in range(4)]
    alone = TargetEngine(models["llama"], None, FixedGamma(0), EngineConfig(max_batch_size=4))
    want = [r.output_ids for r in alone.generate(prompt_ids[:4], params)]
    with BackgroundDraftServer(models["llama"], DraftServerConfig(lookahead="chain")) as srv:
        eng, rp = engine_for(models, srv.address, "s", gamma=4, batch=4)
        eng.send_ahead = rp.send_ahead
        assert rp.wait_attached(10)
        got = [r.output_ids for r in eng.generate(prompt_ids[:4], params)]
        rp.close()
        stats = srv.server.stats.snapshot()
    assert got == want
    assert stats["lookahead_hits"] > 0 and eng.stats.drafted_tokens > 0


def test_a_round_the_server_pushed_drafts_for_takes_them_without_waiting(models, prompt_ids):
    from draft_stream import wait_until

    from benchmarks.fixtures.reference import hf_greedy

    with BackgroundDraftServer(models["llama"], DraftServerConfig(lookahead="chain")) as srv:
        rp = RemoteProposer(srv.address, models["llama"].fingerprint, "p", 2.0, backoff_s=(0.02, 0.2))
        assert rp.wait_attached(10)
        prompt = list(prompt_ids[0])
        drafts = rp.propose([DraftRequest("s", 0, prompt, 3)])[0]
        # The server drafts the likeliest next round ahead (all accepted, its own bonus guess) and pushes it.
        wait_until(lambda: srv.server.stats.snapshot()["lookahead_drafted_tokens"] >= 4, timeout=10)
        wait_until(lambda: len(rp.staged._by_wire) == 1, timeout=5)
        new = drafts + hf_greedy(models["llama"], prompt + drafts, 1)
        rounds = rp.stats.rounds
        pushed = rp.propose([DraftRequest("s", len(prompt), new, 3)])[0]
        assert rp.staged.used == 1 and rp.stats.rounds == rounds  # answered here, not by a reply
        # The server still got the round (a hit) and its reply, dropped on arrival, had the same drafts.
        wait_until(lambda: srv.server.stats.snapshot()["lookahead_hits"] == 1, timeout=5)
        later = rp.propose([DraftRequest("s", len(prompt) + len(new), pushed[:1] + [7], 3)])[0]
        assert len(pushed) == 3 and len(later) == 3
        rp.close()
