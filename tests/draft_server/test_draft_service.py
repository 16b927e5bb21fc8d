"""The draft service over real gRPC on loopback: handshake, isolation, limits, leases, modes."""

import secrets
import threading

import grpc
import pytest
from draft_stream import Stream, attach, fingerprint, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.fixtures.reference import hf_greedy
from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from draft_server.round_check import check_round
from starjar.errors import InvalidArgument
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc


@pytest.fixture()
def server(models):
    srv = BackgroundDraftServer(models["draft"], DraftServerConfig(max_targets=3, max_gamma=8,
                                                                   max_sequences_per_target=4,
                                                                   max_tokens_per_sequence=512, lease_s=30)).start()
    yield srv
    srv.stop(grace=0.5)


@pytest.fixture()
def stub(server):
    ch = grpc.insecure_channel(server.address)
    yield pb_grpc.DraftServiceStub(ch)
    ch.close()


def test_attach_gives_random_128_bit_tags_and_limits(stub, models):
    a, b = attach(stub, models, "a"), attach(stub, models, "b")
    assert len(a.tag) == 16 and len(b.tag) == 16 and a.tag != b.tag
    assert a.limits.max_gamma == 8 and a.limits.max_sequences == 4 and a.limits.lease_seconds == 30


def test_admission_refused_at_n_max_with_reason(stub, models):
    for i in range(3):
        attach(stub, models, f"t{i}")
    with pytest.raises(grpc.RpcError) as err:
        attach(stub, models, "t3")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("starjar-reason", "admission") in err.value.trailing_metadata()


def test_fingerprint_mismatch_is_refused(stub, models):
    with pytest.raises(grpc.RpcError) as err:
        stub.Attach(pb.AttachRequest(worker_id="x", fingerprint=fingerprint(models["other_tok"])))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("starjar-reason", "fingerprint") in err.value.trailing_metadata()


def test_drafts_are_the_greedy_chain_and_positions_are_checked(stub, models):
    tag = attach(stub, models).tag
    s = Stream(stub, tag)
    prompt = [5, 17, 42, 99, 3]
    r = s.round(dict(seq_id=1, start=0, tokens=prompt, gamma=4))
    assert list(r.sequences[0].tokens) == hf_greedy(models["draft"], prompt, 4)[:4]
    assert r.timings.compute_s > 0 and r.timings.batched_rounds == 1
    # The target verified two drafts and picked 77: the next round continues from there.
    verified = prompt + list(r.sequences[0].tokens[:2]) + [77]
    r = s.round(dict(seq_id=1, start=len(prompt), tokens=verified[len(prompt):], gamma=3))
    assert list(r.sequences[0].tokens) == hf_greedy(models["draft"], verified, 3)[:3]
    # A lost message: the next round starts past what the server has. It asks for a resync.
    r = s.round(dict(seq_id=1, start=len(verified) + 5, tokens=[1], gamma=3))
    assert r.sequences[0].resync and not r.sequences[0].tokens
    s.close()


def test_isolation_between_targets(server, stub, models):
    a, b = attach(stub, models, "a").tag, attach(stub, models, "b").tag
    sa, sb = Stream(stub, a), Stream(stub, b)
    sa.round(dict(seq_id=7, start=0, tokens=[5, 6, 7, 8], gamma=2))
    # B names A's sequence id on its own stream: it is a different (tag, id); B learns nothing.
    r = sb.round(dict(seq_id=7, start=4, tokens=[9], gamma=2))
    assert r.sequences[0].resync and not r.sequences[0].tokens
    # B presents A's tag (already streaming) or a guessed one: NOT_FOUND, same message.
    for tag in (a, secrets.token_bytes(16)):
        with pytest.raises(grpc.RpcError) as err:
            Stream(stub, tag).round(dict(seq_id=1, start=0, tokens=[1], gamma=1))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == "unknown tag"
    with pytest.raises(grpc.RpcError) as err:
        stub.Release(pb.ReleaseRequest(tag=secrets.token_bytes(16), seq_ids=[7]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == "unknown tag"
    # B releasing id 7 under its own tag does not touch A's sequence.
    stub.Release(pb.ReleaseRequest(tag=b, seq_ids=[7]))
    r = sa.round(dict(seq_id=7, start=4, tokens=[9], gamma=2))
    assert not r.sequences[0].resync and len(r.sequences[0].tokens) == 2
    sa.close(), sb.close()


@pytest.mark.parametrize("seq", [
    dict(seq_id=1, start=0, tokens=[1, 2], gamma=9),  # gamma over max_gamma 8
    dict(seq_id=1, start=0, tokens=[1, 10**6], gamma=2),  # an id outside the vocabulary
    dict(seq_id=1, start=510, tokens=[1, 2, 3], gamma=2),  # past max_tokens_per_sequence 512
])
def test_a_sequence_over_a_limit_is_answered_resync_and_the_stream_goes_on(server, stub, models, seq):
    """One bad sequence no longer ends its target's whole stream."""
    s = Stream(stub, attach(stub, models).tag)
    good = dict(seq_id=2, start=0, tokens=[5, 6, 7], gamma=2)
    r = s.round(seq, good)
    assert r.sequences[0].resync and not r.sequences[0].tokens  # that one sequence
    assert not r.sequences[1].resync and len(r.sequences[1].tokens) == 2  # the rest of the round is drafted
    r = s.round(dict(seq_id=2, start=3, tokens=[r.sequences[1].tokens[0]], gamma=1))  # the stream goes on
    assert len(r.sequences[0].tokens) == 1
    assert server.server.stats.snapshot()["bad_sequences"] == 1
    s.close()


def test_duplicate_and_too_many_sequences(stub, models):
    s = Stream(stub, attach(stub, models).tag)
    with pytest.raises(grpc.RpcError) as err:
        s.round(dict(seq_id=1, start=0, tokens=[1], gamma=1), dict(seq_id=1, start=0, tokens=[2], gamma=1))
    assert "sequences[1].seq_id: must be unique" in err.value.details()
    s = Stream(stub, attach(stub, models).tag)
    with pytest.raises(grpc.RpcError) as err:
        s.round(*[dict(seq_id=i, start=0, tokens=[1], gamma=1) for i in range(5)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sequences: at most 4" in err.value.details()


def test_bad_attach_and_release(stub, models):
    with pytest.raises(grpc.RpcError) as err:
        stub.Attach(pb.AttachRequest(worker_id="", fingerprint=fingerprint(models["llama"])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in err.value.details()
    tag = attach(stub, models).tag
    with pytest.raises(grpc.RpcError) as err:
        stub.Release(pb.ReleaseRequest(tag=tag, seq_ids=list(range(10))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seq_ids: at most 4" in err.value.details()


def test_release_stream_end_and_lease_free_everything(models):
    cfg = DraftServerConfig(lease_s=0.4)
    with BackgroundDraftServer(models["draft"], cfg) as srv:
        stub = pb_grpc.DraftServiceStub(grpc.insecure_channel(srv.address))
        engine = srv.server.compute.engine
        tag = attach(stub, models).tag
        s = Stream(stub, tag)
        s.round(*[dict(seq_id=i, start=0, tokens=[1, 2, 3], gamma=1) for i in range(3)])
        assert engine.num_sequences == 3
        assert stub.Release(pb.ReleaseRequest(tag=tag, seq_ids=[0, 99])).released == 1
        wait_until(lambda: engine.num_sequences == 2)
        s.close()  # stream ends: the tag is detached and its sequences freed
        wait_until(lambda: engine.num_sequences == 0 and len(srv.server.sessions) == 0)
        # A target that attaches and vanishes: its tag is reclaimed after the lease.
        attach(stub, models)
        assert len(srv.server.sessions) == 1
        wait_until(lambda: len(srv.server.sessions) == 0, timeout=5)
        # A live stream whose sequence is never used again: reclaimed, later rounds resync.
        s = Stream(stub, attach(stub, models).tag)
        s.round(dict(seq_id=5, start=0, tokens=[1, 2, 3], gamma=1))
        wait_until(lambda: engine.num_sequences == 0, timeout=5)
        assert s.round(dict(seq_id=5, start=3, tokens=[4], gamma=1)).sequences[0].resync
        assert srv.server.stats.reclaimed_sequences >= 1
        s.close()


@pytest.mark.parametrize("mode", ["batched", "fifo"])
def test_modes_batch_rounds_of_all_targets_or_not(models, mode):
    with BackgroundDraftServer(models["draft"], DraftServerConfig(mode=mode)) as srv:
        stub = pb_grpc.DraftServiceStub(grpc.insecure_channel(srv.address))
        seen = []

        def target(k):
            s = Stream(stub, attach(stub, models, f"t{k}").tag)
            toks = [10 + k, 11, 12]
            for _ in range(15):
                r = s.round(dict(seq_id=1, start=0, tokens=toks, gamma=4))
                seen.append(r.timings.batched_rounds)
            s.close()

        threads = [threading.Thread(target=target, args=(k,)) for k in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        stats = pb_grpc.DraftServiceStub(grpc.insecure_channel(srv.address)).GetStats(pb.GetStatsRequest())
        # Per-target figures go with the target; the totals stay.
        assert stats.mode == mode and stats.rounds == 60 and len(stats.targets) == 0
        assert 0 < stats.load <= 1 and stats.mean_step_s > 0 and stats.mean_service_s > 0
        # Each round needs gamma = 4 passes: fifo runs them round by round, batched shares them.
        if mode == "fifo":
            assert set(seen) == {1} and stats.draft_steps == 60 * 4
        else:
            assert max(seen) > 1 and stats.draft_steps < 60 * 4


def test_health_and_reflection(server):
    ch = grpc.insecure_channel(server.address)
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="starjar.v1.DraftService"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "starjar.v1.DraftService" in names and "grpc.health.v1.Health" in names


def test_round_checks_are_pure():
    """A round's checks touch no session: what is live goes in and comes out unchanged, and a
    sequence past a limit is answered resync while the others go on; only a malformed round is an error."""
    cfg = DraftServerConfig(max_sequences_per_target=3, max_gamma=4, max_tokens_per_sequence=16)
    live = {1, 2}
    seqs = [pb.SequenceRound(seq_id=1, start=0, tokens=[5], gamma=2),  # live: fine
            pb.SequenceRound(seq_id=7, start=0, tokens=[5], gamma=2),  # new: the third live one
            pb.SequenceRound(seq_id=8, start=0, tokens=[5], gamma=2),  # new: a fourth is one too many
            pb.SequenceRound(seq_id=2, start=0, tokens=[5], gamma=9),  # gamma past the limit
            pb.SequenceRound(seq_id=9, start=10, tokens=[5] * 7, gamma=1)]  # 17 tokens > 16
    with pytest.raises(InvalidArgument, match="sequences: at most 3 per round"):
        check_round(seqs, cfg, vocab_size=100, live=live)
    problems = check_round(seqs[:3], cfg, vocab_size=100, live=live)
    assert problems[:2] == [None, None] and "more than 3 live" in problems[2]
    assert [p is None for p in check_round(seqs[3:] + [pb.SequenceRound(seq_id=3, tokens=[100])], cfg, 100, live)] \
        == [False, False, False]
    with pytest.raises(InvalidArgument, match=r"sequences\[1\]\.seq_id: must be unique"):
        check_round([seqs[0], seqs[0]], cfg, 100, live)
    assert live == {1, 2}
