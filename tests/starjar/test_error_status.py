"""Errors map to status codes in one place (starjar.service.status), the field at fault travels as
trailing metadata (starjar-field) through the front end to the SDK and the HTTP "param", and an unexpected
exception is INTERNAL "internal error" whose message reaches neither the caller nor the log."""

from __future__ import annotations

import json
import logging
import secrets
import urllib.error
import urllib.request

import grpc
import pytest
from fault_servers import Worker

from controller.frontend.server import FrontEnd
from starjar import Client, InvalidRequest
from starjar.errors import (
    BadCredentials,
    FailedPrecondition,
    InternalFailure,
    InvalidArgument,
    NotFound,
    NotServing,
    ServerBusy,
    TimedOut,
)
from starjar.service.serving import BackgroundLoop
from starjar.service.status import ErrorStatus, Status, status_of
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc

SC = grpc.StatusCode


@pytest.mark.parametrize("exc,want", [
    (InvalidArgument("top_p", "must be in (0, 1]", 2.0),
     Status(SC.INVALID_ARGUMENT, "invalid top_p: must be in (0, 1] (got 2.0)", None, "top_p")),
    (NotFound("unknown tag"), Status(SC.NOT_FOUND, "unknown tag")),
    (FailedPrecondition("fingerprint: differs", reason="fingerprint"),
     Status(SC.FAILED_PRECONDITION, "fingerprint: differs", "fingerprint")),
    (ServerBusy("full", reason="queue_full"), Status(SC.RESOURCE_EXHAUSTED, "full", "queue_full")),
    (NotServing("engine stopped"), Status(SC.UNAVAILABLE, "engine stopped")),
    (BadCredentials("wrong token"), Status(SC.UNAUTHENTICATED, "wrong token")),
    (TimedOut("too slow", reason="timeout"), Status(SC.DEADLINE_EXCEEDED, "too slow", "timeout")),
    (InternalFailure("engine failed"), Status(SC.INTERNAL, "engine failed")),
    (RuntimeError("anything else"), None),
    (ValueError("not ours either"), None),
])
def test_one_table(exc, want):
    assert status_of(exc) == want


def test_a_failed_upstream_call_passes_on_as_it_came():
    trailing = grpc.aio.Metadata(("starjar-reason", "queue_full"), ("starjar-field", "prompt"))
    exc = grpc.aio.AioRpcError(SC.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailing, "3 waiting")
    assert status_of(exc) == Status(SC.RESOURCE_EXHAUSTED, "3 waiting", "queue_full", "prompt")


class _Broken(pb_grpc.GenerateServiceServicer):
    def __init__(self, marker: str):
        self.marker = marker

    async def Generate(self, request, context):
        raise RuntimeError(self.marker)  # stands for a bug whose message quotes the prompt
        yield pb.GenerateResponse()  # unreachable: makes this the async generator a streaming method is


def test_an_unexpected_error_is_internal_and_its_message_stays_private(caplog):
    marker = secrets.token_hex(8)
    loop = BackgroundLoop("test-broken")

    async def start():
        server = grpc.aio.server(interceptors=[ErrorStatus()])
        pb_grpc.add_GenerateServiceServicer_to_server(_Broken(marker), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port
    server, port = loop.run(start())
    try:
        with caplog.at_level(logging.DEBUG), grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.GenerateServiceStub(ch).Generate(pb.GenerateRequest(prompt="hi"), timeout=30))
        assert err.value.code() == SC.INTERNAL and err.value.details() == "internal error"
        assert "RuntimeError" in caplog.text and "Generate" in caplog.text  # logged, by type and place
        assert marker not in caplog.text and marker not in (err.value.debug_error_string() or "")
    finally:
        loop.run(server.stop(0))
        loop.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_field_travels_as_metadata_from_the_worker_to_every_caller(models):
    """A prompt too long for the model is found by the worker (it has the tokenizer and the context length);
    its field reaches a raw gRPC caller, the SDK and the HTTP "param" without anyone parsing the message."""
    worker = Worker(models["llama"], "w-field")
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        fe.set_targets({"w": worker.address})
        too_long = pb.GenerateRequest(prompt_token_ids=[5] * 600)  # the context is 512
        for address in (worker.address, f"127.0.0.1:{fe.grpc_port}"):
            with grpc.insecure_channel(address) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    list(pb_grpc.GenerateServiceStub(ch).Generate(too_long, timeout=30))
            assert err.value.code() == SC.INVALID_ARGUMENT and "invalid prompt" in err.value.details()
            assert ("starjar-field", "prompt") in err.value.trailing_metadata()
        with Client(f"127.0.0.1:{fe.grpc_port}", timeout=30) as c:
            with pytest.raises(InvalidRequest) as sdk_err:
                c.generate(prompt_token_ids=[5] * 600, max_tokens=4)
            assert sdk_err.value.field == "prompt"
            with pytest.raises(InvalidRequest) as sdk_err:
                c.generate("hi", model="gpt-17")  # the front end's own check
            assert sdk_err.value.field == "model"
        status, body = _post(f"http://127.0.0.1:{fe.http_port}/v1/completions", {"prompt": [5] * 600})
        assert status == 400 and body["error"]["param"] == "prompt"
        assert body["error"]["type"] == "invalid_request_error"
    finally:
        fe.stop(0.5)
        worker.close()
