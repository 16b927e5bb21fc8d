"""Overload control. A worker holds a full batch plus a bounded waiting queue and refuses the
rest (RESOURCE_EXHAUSTED, starjar-reason queue_full, the limit named); the front end tries another worker,
answers RESOURCE_EXHAUSTED / 429 with Retry-After when all are full, caps its own relays, and never retries a
request that failed while running (UNKNOWN, INTERNAL)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from fault_servers import FakeWorker, Worker, slowed, wait_until
from prometheus_client import generate_latest

from controller.frontend.router import Overloaded as RouterFull
from controller.frontend.router import TargetRouter
from controller.frontend.server import FrontEnd
from starjar import Client, Overloaded
from starjar.spec.sampling import SamplingParams
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc
from starjar.wire.keys import REASON_METADATA
from starjar.wire.request import sampling_to_proto

LONG = SamplingParams(max_tokens=300, ignore_eos=True)  # at 20 ms a step: far longer than any test waits


def _hold(address: str, prompt: list[int]):
    """Start a long generation and leave it running (or queued); cancel() the returned call to end it."""
    channel = grpc.insecure_channel(address)
    call = pb_grpc.GenerateServiceStub(channel).Generate(
        pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling_to_proto(LONG)))
    return channel, call


def _release(*held) -> None:
    for channel, call in held:
        call.cancel()
        channel.close()


def _post(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


@pytest.fixture
def slow_workers(models):
    """Two workers of batch 1 and no waiting room, each step slowed to 20 ms."""
    ws = [Worker(slowed(models["llama"], 0.02), f"w{i}", batch_size=1, max_waiting=0) for i in range(2)]
    yield ws
    for w in ws:
        w.close()


def test_a_full_worker_refuses_with_queue_full_naming_the_limit(models, prompt_ids, reference):
    w = Worker(slowed(models["llama"], 0.02), "w", batch_size=1, max_waiting=1)
    try:
        held = [_hold(w.address, prompt_ids[i]) for i in range(2)]  # one running, one waiting
        assert wait_until(lambda: w.server.admission.held == 2)
        stub = pb_grpc.GenerateServiceStub(grpc.insecure_channel(w.address))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt_ids[2]), timeout=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata())[REASON_METADATA] == "queue_full"
        assert "--max-waiting 1" in err.value.details() and "batch size 1" in err.value.details()
        scrape = generate_latest(w.server.metrics.registry).decode()
        assert 'starjar_target_requests_refused_total{reason="queue_full"} 1.0' in scrape
        _release(*held)
        assert wait_until(lambda: w.server.admission.held == 0)
        with Client(w.address, timeout=30) as c:  # room again; the output is the target's own
            assert c.generate(prompt_token_ids=prompt_ids[2], max_tokens=8).token_ids == reference("llama")[2][:8]
    finally:
        w.close()


def test_the_front_end_tries_another_worker_then_answers_429_when_all_are_full(models, slow_workers, prompt_ids,
                                                                              reference):
    a, b = slow_workers
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    held = []
    try:
        fe.set_targets({"a": a.address, "b": b.address})
        held.append(_hold(a.address, prompt_ids[0]))
        assert wait_until(lambda: a.server.runner.engine.num_running == 1)
        with Client(f"127.0.0.1:{fe.grpc_port}", timeout=30) as c:  # the first pick is a: full, so b serves it
            outs = [c.generate(prompt_token_ids=p, max_tokens=8).token_ids for p in prompt_ids[1:3]]
        assert outs == [r[:8] for r in reference("llama")[1:3]]
        assert a.server.admission.refused >= 1

        held.append(_hold(b.address, prompt_ids[3]))
        assert wait_until(lambda: b.server.runner.engine.num_running == 1)
        with Client(f"127.0.0.1:{fe.grpc_port}", timeout=30) as c:
            with pytest.raises(Overloaded) as err:
                c.generate(prompt_token_ids=prompt_ids[4], max_tokens=8)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "queue_full"
        status, headers, body = _post(f"http://127.0.0.1:{fe.http_port}/v1/completions",
                                      {"prompt": "hi", "max_tokens": 4})
        assert status == 429 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "queue_full" and "--max-waiting 0" in body["error"]["message"]
        status, headers, body = _post(f"http://127.0.0.1:{fe.http_port}/v1/completions",
                                      {"prompt": "hi", "max_tokens": 4, "stream": True})
        assert status == 429 and body["error"]["code"] == "queue_full"
        assert fe.in_flight() == {"a": 0, "b": 0}
        scrape = generate_latest(fe.registry).decode()
        assert 'starjar_frontend_requests_refused_total{reason="queue_full"} 3.0' in scrape
    finally:
        _release(*held)
        fe.stop(0.5)


def test_the_front_end_caps_its_own_relays(models, slow_workers, prompt_ids):
    a, b = slow_workers
    fe = FrontEnd("llama", models["llama"].tokenizer, max_requests=1).start()
    held = []
    try:
        fe.set_targets({"a": a.address, "b": b.address})
        held.append(_hold(f"127.0.0.1:{fe.grpc_port}", prompt_ids[0]))
        assert wait_until(lambda: sum(fe.in_flight().values()) == 1)
        with Client(f"127.0.0.1:{fe.grpc_port}", timeout=30) as c:
            with pytest.raises(Overloaded) as err:
                c.generate(prompt_token_ids=prompt_ids[1], max_tokens=4)
        assert err.value.reason == "front_end_full" and "--max-requests 1" in err.value.details
        status, headers, body = _post(f"http://127.0.0.1:{fe.http_port}/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 429 and headers["Retry-After"] == "1" and body["error"]["code"] == "front_end_full"
    finally:
        _release(*held)
        fe.stop(0.5)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_the_router_never_retries_a_request_that_may_have_run(models, code, prompt_ids):
    """UNKNOWN and INTERNAL may mean the request ran, or broke its worker: it is not tried on another one.
    Nor is a RESOURCE_EXHAUSTED without reason queue_full (gRPC's own, e.g. a message too large): only a full
    queue means "not started here, another may take it"."""
    fake, real = FakeWorker(code), Worker(models["llama"], "real")

    async def relay():
        router = TargetRouter()
        router.update({"fake": fake.address, "real": real.address})  # a fresh router picks the first on a tie
        try:
            req = pb.GenerateRequest(prompt_token_ids=prompt_ids[0], sampling=sampling_to_proto(
                SamplingParams(max_tokens=4)))
            return [r async for r in router.generate(req, timeout=30)]
        finally:
            await router.close()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(relay())
        assert err.value.code() == code and fake.service.calls == 1
    finally:
        fake.close()
        real.close()


def test_relays_to_a_worker_that_missed_a_poll_still_count(models):
    """A worker dropped from the set for one missed poll and put back at the same address keeps its relays'
    count, and while it is out they still count against --max-requests (before, it came back at 0: the front
    end went past its limit and sent it the next requests as if idle)."""
    hung = FakeWorker(None)  # every request stays in flight

    async def relay():
        router = TargetRouter(max_requests=3)
        router.update({"w": hung.address})
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling_to_proto(SamplingParams(max_tokens=4)))

        async def one():
            async for _ in router.generate(req, timeout=30):
                pass
        tasks = [asyncio.create_task(one()) for _ in range(3)]
        try:
            for _ in range(200):
                await asyncio.sleep(0.01)
                if router.in_flight() == {"w": 3}:
                    break
            router.update({})  # a missed poll
            with pytest.raises(RouterFull):
                await one()  # no worker: but three relays still hold every place
            router.update({"w": hung.address})  # back at the same address
            assert router.in_flight() == {"w": 3}
            with pytest.raises(RouterFull):
                await one()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert router.in_flight() == {"w": 0}
            router.update({})
            assert not router._leaving  # nothing in flight: nothing kept of a worker that left
        finally:
            for t in tasks:
                t.cancel()
            await router.close()
    try:
        asyncio.run(relay())
    finally:
        hung.close()
