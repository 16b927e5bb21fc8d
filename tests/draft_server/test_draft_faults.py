"""The draft server's compute loop and sweeper survive their own failures, and health says
when drafting has stopped."""

import grpc
from draft_stream import Stream, attach, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from starjar.v1 import draft_pb2_grpc as pb_grpc


def test_a_round_whose_start_raises_is_answered_resync_and_drafting_goes_on(models):
    with BackgroundDraftServer(models["draft"]) as srv:
        engine = srv.server.compute.engine
        start, calls = engine.start, {"n": 0}

        def flaky(requests):  # fault injection: the first round's start raises
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return start(requests)

        engine.start = flaky
        ch = grpc.insecure_channel(srv.address)
        stub = pb_grpc.DraftServiceStub(ch)
        s = Stream(stub, attach(stub, models).tag)
        r = s.round(dict(seq_id=1, start=0, tokens=[5, 6, 7], gamma=2), timeout=10)
        assert r.sequences[0].resync  # answered, not dropped
        r = s.round(dict(seq_id=1, start=0, tokens=[5, 6, 7], gamma=2), timeout=10)
        assert len(r.sequences[0].tokens) == 2 and srv.server.compute.is_alive()
        s.close()
        ch.close()


def test_a_failing_sweep_does_not_end_the_sweeper(models):
    cfg = DraftServerConfig(lease_s=0.2)
    with BackgroundDraftServer(models["draft"], cfg) as srv:
        reclaim, calls = srv.server.service.reclaim_expired, {"n": 0}

        def flaky():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return reclaim()

        srv.server.service.reclaim_expired = flaky
        wait_until(lambda: calls["n"] >= 3, timeout=5)  # it kept sweeping after the failure


def test_health_turns_not_serving_when_the_compute_thread_is_gone(models):
    with BackgroundDraftServer(models["draft"], DraftServerConfig(lease_s=0.2)) as srv:
        ch = grpc.insecure_channel(srv.address)
        health = health_pb2_grpc.HealthStub(ch)

        def status():
            return health.Check(health_pb2.HealthCheckRequest(service="starjar.v1.DraftService")).status

        assert status() == health_pb2.HealthCheckResponse.SERVING
        srv.server.queue.close()  # the compute thread ends, as if it had died
        srv.server.compute.join(5)
        wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        ch.close()
