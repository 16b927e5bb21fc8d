"""Faults at the front end: a worker whose engine died is routed around (its requests had not
started), no relay outlives the request timeout, an HTTP client that leaves stops its generation even when it
is not streaming, and a prompt being tokenized does not hold up the worker's other requests."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from fault_servers import FakeWorker, GatedTokenizer, Worker, broken, own_copy, slowed, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.frontend.server import FrontEnd
from starjar import Client, Timeout
from target_worker.runner import MAX_FAILED_STEPS


def _post(url: str, body: dict, timeout: float = 30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _nothing_runs_on(w: Worker, fe: FrontEnd) -> None:
    """Within 3 s the worker runs nothing and the front end relays nothing, well short of a 300-token run."""
    t0 = time.monotonic()
    assert wait_until(lambda: w.server.runner.engine.num_running == 0 and fe.in_flight() == {"w": 0}, 3)
    assert w.server.runner.engine.stats.decode_steps < 300 and time.monotonic() - t0 < 3


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_requests_go_around_a_worker_whose_engine_died(models, prompt_ids, reference):
    dead, alive = Worker(broken(models["llama"]), "dead"), Worker(models["llama"], "alive")
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        with Client(dead.address, timeout=30) as c:  # kill its engine: every step fails, then it gives up
            for i in range(MAX_FAILED_STEPS):
                with pytest.raises(Exception, match="INTERNAL"):
                    c.generate(prompt_token_ids=prompt_ids[i], max_tokens=4)
        assert wait_until(lambda: _health(dead.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
        fe.set_targets({"dead": dead.address, "alive": alive.address})
        with Client(f"127.0.0.1:{fe.grpc_port}", timeout=30) as c:
            outs = [c.generate(prompt_token_ids=p, max_tokens=8).token_ids for p in prompt_ids[:4]]
        assert outs == [r[:8] for r in reference("llama")[:4]]
        status, body = _post(f"http://127.0.0.1:{fe.http_port}/v1/completions",
                             {"prompt": prompt_ids[4], "max_tokens": 8, "temperature": 0})
        assert status == 200
        assert models["llama"].tokenizer.decode(reference("llama")[4][:8]) == body["choices"][0]["text"]
    finally:
        fe.stop(0.5)
        dead.close()
        alive.close()


def test_a_request_queued_on_an_engine_that_dies_is_retried_elsewhere(models, prompt_ids, reference):
    """It never ran there (UNAVAILABLE "engine stopped"), so the front end may run it on another worker; the
    requests that failed while running (INTERNAL) are not retried."""
    gate, entered = threading.Event(), threading.Event()
    dying = Worker(broken(models["llama"], gate, entered), "dying", batch_size=1)
    alive = Worker(models["llama"], "alive")
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    errors, result = [], {}

    def direct(i):
        try:
            with Client(dying.address, timeout=30) as c:
                c.generate(prompt_token_ids=prompt_ids[i], max_tokens=4)
        except Exception as exc:  # noqa: BLE001 - each must fail; the test checks how
            errors.append(str(exc))

    def relayed():
        try:
            with Client(f"127.0.0.1:{fe.grpc_port}", timeout=30) as c:
                result["out"] = c.generate(prompt_token_ids=prompt_ids[3], max_tokens=8)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc
    try:
        fe.set_targets({"dying": dying.address, "alive": alive.address})  # a fresh router tries "dying" first
        threads = [threading.Thread(target=direct, args=(i,)) for i in range(MAX_FAILED_STEPS)]
        threads.append(threading.Thread(target=relayed))
        threads[0].start()
        assert entered.wait(10)  # the first failing step holds the engine; the rest queue behind it
        for n, t in enumerate(threads[1:], start=2):
            t.start()
            assert wait_until(lambda n=n: dying.server.runner.load == n)  # submitted, in this order
        gate.set()  # three steps fail in a row: the engine stops with the relayed request still queued
        for t in threads:
            t.join(30)
        assert len(errors) == MAX_FAILED_STEPS and all("INTERNAL" in e for e in errors)
        assert "out" in result, result.get("error")
        assert result["out"].token_ids == reference("llama")[3][:8]
    finally:
        gate.set()
        fe.stop(0.5)
        dying.close()
        alive.close()


def test_no_relay_outlives_the_request_timeout(models):
    hung = FakeWorker(None)  # accepts the call and never answers
    fe = FrontEnd("llama", models["llama"].tokenizer, request_timeout_s=1.0).start()
    try:
        fe.set_targets({"hung": hung.address})
        url = f"http://127.0.0.1:{fe.http_port}/v1/completions"
        for stream in (False, True):
            t0 = time.monotonic()
            status, body = _post(url, {"prompt": "hi", "max_tokens": 4, "stream": stream}, timeout=20)
            assert status == 504 and "--request-timeout" in body["error"]["message"]
            assert time.monotonic() - t0 < 10
        with Client(f"127.0.0.1:{fe.grpc_port}") as c:  # the caller sets no deadline; the front end's holds
            with pytest.raises(Timeout, match="--request-timeout"):
                c.generate("hi", max_tokens=4)
        assert fe.in_flight() == {"hung": 0}
    finally:
        fe.stop(0.5)
        hung.close()


@pytest.mark.parametrize("stream", [False, True])
def test_an_http_client_that_leaves_stops_its_generation(models, prompt_ids, stream):
    """Non-streaming requests write nothing until the end, so only the handler's cancellation can notice."""
    w = Worker(slowed(models["llama"], 0.02), "w")  # 300 tokens would take 6 s or more
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        fe.set_targets({"w": w.address})
        body = json.dumps({"prompt": prompt_ids[0], "max_tokens": 300, "ignore_eos": True,
                           "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", fe.http_port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: w.server.runner.engine.num_running == 1)
        sock.close()
        _nothing_runs_on(w, fe)
    finally:
        fe.stop(0.5)
        w.close()


def test_a_prompt_being_tokenized_does_not_hold_up_other_requests(models, prompt_ids, reference):
    model = own_copy(models["llama"])
    model.tokenizer = GatedTokenizer(model.tokenizer)  # tokenizing "SLOW..." takes until the gate opens
    w = Worker(model, "w")
    slow_result = {}
    try:
        def slow_request():
            with Client(w.address, timeout=60) as c:
                slow_result["out"] = c.generate("SLOW prompt", max_tokens=4)
        t = threading.Thread(target=slow_request)
        t.start()
        assert model.tokenizer.entered.wait(10)
        with Client(w.address, timeout=10) as c:  # served while the other prompt is still being tokenized
            assert c.generate(prompt_token_ids=prompt_ids[0], max_tokens=8).token_ids == reference("llama")[0][:8]
        assert t.is_alive()
    finally:
        model.tokenizer.gate.set()
        t.join(30)
        w.close()
    assert slow_result["out"].finish_reason in ("stop", "length")


def test_a_failing_choice_stops_the_other_choices_of_a_whole_response(models, prompt_ids):
    """A non-streaming request with several prompts, one of them rejected by the worker: the client gets the
    error at once, and the other prompts' generations stop with it (before, they ran to max_tokens)."""
    w = Worker(slowed(models["llama"], 0.02), "w")  # 300 tokens would take 6 s or more
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        fe.set_targets({"w": w.address})
        bad = [models["llama"].vocab_size + 7]  # out of the vocabulary: only the worker rejects it
        status, body = _post(f"http://127.0.0.1:{fe.http_port}/v1/completions",
                             {"prompt": [prompt_ids[0], prompt_ids[1], bad], "max_tokens": 300,
                              "ignore_eos": True})
        assert status == 400, body
        _nothing_runs_on(w, fe)
    finally:
        fe.stop(0.5)
        w.close()
