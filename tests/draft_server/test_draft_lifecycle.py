"""Sessions end when they should, every buffer on the draft server is bounded, and a
target stops waiting on a draft server that does not answer."""

import threading
import time

import grpc
import pytest
from draft_stream import Stream, attach, wait_until
from fault_proxy import FaultProxy

from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from starjar.model.loading import kv_bytes_per_token
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.breaker import Breaker
from target_worker.remote.client import RemoteProposer


def _reason(err: grpc.RpcError) -> str:
    return dict(err.trailing_metadata() or ()).get("starjar-reason", "")


def test_detach_while_streaming_ends_the_stream_and_frees_its_slot(models):
    with BackgroundDraftServer(models["draft"], DraftServerConfig(max_targets=1)) as srv:
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        tag = attach(stub, models).tag
        s = Stream(stub, tag)
        s.round(dict(seq_id=1, start=0, tokens=[5, 6, 7], gamma=2))
        assert srv.server.compute.engine.num_sequences == 1
        assert stub.Release(pb.ReleaseRequest(tag=tag, detach=True)).released == 1
        with pytest.raises(grpc.RpcError) as err:  # before: the stream went on, outside admission
            s.round(dict(seq_id=2, start=0, tokens=[5, 6], gamma=2), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and _reason(err.value) == "detached"
        wait_until(lambda: srv.server.compute.engine.num_sequences == 0 and len(srv.server.sessions) == 0)
        attach(stub, models, "next")  # the slot is free again
        ch.close()


def test_a_target_that_vanished_is_found_by_keepalive(models):
    cfg = DraftServerConfig(keepalive_s=0.3, keepalive_timeout_s=0.5)
    with BackgroundDraftServer(models["draft"], cfg) as srv:
        proxy = FaultProxy(srv.address)
        ch = grpc.insecure_channel(proxy.address)
        stub = pb_grpc.DraftServiceStub(ch)
        s = Stream(stub, attach(stub, models).tag)
        s.round(dict(seq_id=1, start=0, tokens=[5, 6, 7], gamma=2))
        proxy.set_mode("blackhole")  # no FIN, no RST: the host is simply gone
        t0 = time.monotonic()
        wait_until(lambda: len(srv.server.sessions) == 0, timeout=10)
        assert time.monotonic() - t0 < 5  # before: held until the lease, or for ever while "streaming"
        wait_until(lambda: srv.server.compute.engine.num_sequences == 0)
        proxy.close()
        ch.close()


def test_an_idle_stream_is_ended_and_its_slot_freed(models):
    with BackgroundDraftServer(models["draft"], DraftServerConfig(stream_idle_s=0.4)) as srv:
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        s = Stream(stub, attach(stub, models).tag)
        s.round(dict(seq_id=1, start=0, tokens=[5, 6, 7], gamma=2))
        wait_until(lambda: len(srv.server.sessions) == 0, timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            s.round(dict(seq_id=1, start=3, tokens=[8], gamma=2), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and _reason(err.value) == "idle"
        ch.close()


def test_a_stream_has_at_most_two_rounds_in_flight(models, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_FAULTS", "hang_after=0")  # the server never answers
    with BackgroundDraftServer(models["draft"]) as srv:
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        s = Stream(stub, attach(stub, models).tag)
        for k in range(6):  # sent without waiting for answers
            s._q.put(pb.SpeculateRequest(round_id=k + 1, sequences=[
                pb.SequenceRound(seq_id=k + 1, start=0, tokens=[5, 6], gamma=2)]))
        time.sleep(1.0)
        session = srv.server.sessions.sessions()[0]
        assert session.rounds == 2  # before: all 6 taken and queued
        s.close()
        ch.close()


def test_a_full_queue_answers_resource_exhausted_with_a_reason(models, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_FAULTS", "hang_after=0")
    with BackgroundDraftServer(models["draft"], DraftServerConfig(max_queued_rounds=1)) as srv:
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        streams = [Stream(stub, attach(stub, models, f"t{k}").tag) for k in range(3)]
        errors = []

        def send(s, k):
            try:
                s.round(dict(seq_id=1, start=0, tokens=[5, 6], gamma=2), timeout=5)
            except grpc.RpcError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(s, k), daemon=True) for k, s in enumerate(streams)]
        for t in threads:
            t.start()
            time.sleep(0.3)  # the first is taken (and hangs), the second waits in the queue
        wait_until(lambda: errors, timeout=5)
        assert errors[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _reason(errors[0]) == "queue_full"
        assert srv.server.stats.queue_full == 1
        ch.close()


def test_the_kv_budget_answers_resync_and_bounds_the_cache(models):
    cfg = DraftServerConfig(max_kv_tokens=2048, max_kv_tokens_per_target=700, max_tokens_per_sequence=4096)
    with BackgroundDraftServer(models["draft"], cfg) as srv:
        engine = srv.server.compute.engine
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        a = Stream(stub, attach(stub, models, "a").tag)
        prompt = [5 + (i % 50) for i in range(400)]
        r = a.round(dict(seq_id=1, start=0, tokens=prompt, gamma=2))
        assert len(r.sequences[0].tokens) == 2
        # The target's second 400-token sequence would pass its 700 tokens: that one resyncs, the first goes on.
        r = a.round(dict(seq_id=1, start=400, tokens=[9], gamma=2), dict(seq_id=2, start=0, tokens=prompt, gamma=2))
        assert len(r.sequences[0].tokens) == 2 and r.sequences[1].resync
        # Other targets fill the global budget (live sequences x the longest): past it, resync.
        answers, streams = [], []  # (a stream that is collected ends, and its session with it)
        for k in range(6):
            streams.append(Stream(stub, attach(stub, models, f"b{k}").tag))
            answers.append(streams[-1].round(dict(seq_id=1, start=0, tokens=prompt, gamma=2)).sequences[0].resync)
        assert answers[:4] == [False] * 4 and all(answers[4:])  # 5 x 403 > 2048
        assert engine.cache.nbytes() <= 1.1 * cfg.max_kv_tokens * kv_bytes_per_token(models["draft"])
        assert engine.over_budget >= 3
        ch.close()


def test_a_hung_draft_server_costs_a_few_deadlines_not_one_per_step(models, prompt_ids, reference, monkeypatch):
    ref = reference("llama", 32)
    monkeypatch.setenv("STARJAR_DRAFT_FAULTS", "hang_after=3")  # answers three rounds, then hangs for good
    with BackgroundDraftServer(models["draft"]) as srv:
        rp = RemoteProposer(srv.address, models["llama"].fingerprint, "t", deadline_s=0.3,
                            breaker=Breaker(after=3, probe_s=0.5, max_probe_s=2.0))
        assert rp.wait_attached(10)
        observed = []

        class Recording(FixedGamma):
            def observe(self, *args):
                observed.append(args)

        eng = TargetEngine(models["llama"], rp, Recording(3), EngineConfig(max_batch_size=1))
        reqs = eng.generate(prompt_ids, SamplingParams(max_tokens=32))
        assert [r.output_ids for r in reqs] == ref
        # Before: every speculative step waited out the deadline (about 30 x 0.3 s here).
        assert rp.stats.fallbacks["deadline"] <= 4 and rp.breaker.opened >= 1
        assert rp.stats.fallbacks["breaker_open"] + rp.stats.fallbacks["backlog"] > 10
        # The steps that waited are nobody's statistics: the policy saw only the ones that drafted.
        st = eng.stats
        assert len(observed) == st.spec.steps + st.plain.steps - st.draft_prefill_steps and st.fallback.steps > 10
        rp.close()


def test_speculation_resumes_after_a_slow_spell_of_the_draft_server(models, prompt_ids, reference, monkeypatch):
    """Three rounds answered late open the breaker; the late answers arrive meanwhile, so its probes must find
    no backlog and speculation must come back. (Before: late answers were read only while awaiting a round, so
    the two unanswered rounds stayed counted and every probe failed as a backlog: no drafts ever again. In the
    demo a 769-token prompt's first round, which carries the whole prompt, started exactly that.)"""
    ref = reference("llama", 32)
    monkeypatch.setenv("STARJAR_DRAFT_FAULTS", "spell_from=3,spell_rounds=3,spell_ms=700")
    with BackgroundDraftServer(models["draft"]) as srv:
        rp = RemoteProposer(srv.address, models["llama"].fingerprint, "t", deadline_s=0.3,
                            breaker=Breaker(after=3, probe_s=0.3, max_probe_s=1.0))
        assert rp.wait_attached(10)
        eng = TargetEngine(models["llama"], rp, FixedGamma(3), EngineConfig(max_batch_size=1))
        reqs = eng.generate(prompt_ids, SamplingParams(max_tokens=32))
        assert [r.output_ids for r in reqs] == ref
        assert rp.breaker.opened >= 1 and rp.stats.fallbacks["deadline"] >= 1
        # The spell holds the server for 2.1 s and the probes back off to 0.6 s: a fast machine (a 2-core Zen 5
        # EPYC) decodes every prompt before the probe that finds it well. Decode on until it has (at most 10 s).
        until = time.monotonic() + 10
        while rp.breaker.is_open and time.monotonic() < until:
            again = eng.generate(prompt_ids[:2], SamplingParams(max_tokens=32))
            assert [r.output_ids for r in again] == ref[:2]
        assert not rp.breaker.is_open  # a probe was answered
        rounds = rp.stats.rounds
        again = eng.generate(prompt_ids[:4], SamplingParams(max_tokens=32))
        assert [r.output_ids for r in again] == ref[:4]
        assert rp.stats.rounds >= rounds + 20  # after the spell the steps draft again
        rp.close()
