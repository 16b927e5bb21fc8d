"""Hostile inputs are refused with a reason, never answered with an internal error or a traceback:
temperatures past the limit (inf, 1e39) and a top_p that float32 turns into 0, an Authorization header that is
not UTF-8, and bytes that are not the protobuf a gRPC method takes (on the front end, a target worker and the
draft server, after the token check)."""

from __future__ import annotations

import json
import logging
import socket

import grpc
import pytest
import torch
from draft_stream import fingerprint

from controller.colocated import colocated_engine
from controller.frontend.server import FrontEnd
from draft_server.background import BackgroundDraftServer
from starjar.errors import InvalidArgument
from starjar.service.security import Security, token_matches
from starjar.service.serving import BackgroundLoop
from starjar.spec.sampling import SamplingParams, logits_to_probs
from starjar.v1 import draft_pb2, draft_pb2_grpc
from starjar.v1 import generate_pb2 as gen_pb
from target_worker.config import TargetWorkerConfig
from target_worker.server import TargetServer

TOKEN = "hostile-inputs-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
GENERATE = "/starjar.v1.GenerateService/Generate"
SC = grpc.StatusCode


@pytest.fixture(scope="module")
def worker(models):
    loop = BackgroundLoop("hostile-target")
    server = TargetServer(models["llama"], TargetWorkerConfig(worker_id="w0"), security=Security(token=TOKEN))
    loop.run(server.start())
    yield f"127.0.0.1:{server.port}"
    loop.run(server.stop(0.5))
    loop.stop()


@pytest.fixture(scope="module")
def front_end(models, worker):
    fe = FrontEnd("llama", models["llama"].tokenizer, auth_token=TOKEN, upstream=Security(token=TOKEN)).start()
    fe.set_targets({"w0": worker})
    yield fe
    fe.stop(0.5)


def _errors(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


# ---- sampling: temperature and top_p at and past their limits -----------------------------------------------

@pytest.mark.parametrize("value", [float("inf"), 1e39, 3.0e38, 1e300, 10**400, 100.00001],
                         ids=["inf", "1e39", "3e38", "1e300", "10**400", "just-past"])
def test_a_temperature_past_the_limit_is_refused_naming_it(value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(temperature=value)
    assert err.value.field == "temperature" and "<= 100" in err.value.limit, err.value


@pytest.mark.parametrize("value", [1e-300, 1e-40, 1e-45])
def test_a_top_p_float32_would_turn_into_0_is_refused_with_the_value_sent(value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(top_p=value)
    assert err.value.field == "top_p" and f"got {value!r}" in str(err.value), err.value


def test_every_accepted_value_survives_the_wires_float32():
    """What one side accepts the other accepts after float32: the limits are float32 numbers."""
    from starjar.spec.sampling import MAX_TEMPERATURE, MIN_TOP_P

    for temperature, top_p in ((MAX_TEMPERATURE, MIN_TOP_P), (MAX_TEMPERATURE * (1 - 1e-12), MIN_TOP_P * 1.01)):
        wire = gen_pb.SamplingParams(temperature=temperature, top_p=top_p)
        back = SamplingParams(temperature=wire.temperature, top_p=wire.top_p)
        assert back.temperature <= MAX_TEMPERATURE and back.top_p >= MIN_TOP_P


@pytest.mark.parametrize("temperature", [100.0, 2.0])
def test_top_k_1_keeps_the_argmax_alone_however_close_the_runner_up(temperature):
    """Logits a denormal apart become equal once divided by a large temperature; the cut must see the logits
    as they were, so top_k=1 keeps only the argmax and top_p keeps the larger of the two."""
    tiny = torch.finfo(torch.float32).smallest_normal / 2**23  # the smallest positive float32
    logits = torch.tensor([0.0, tiny, -1.0, -2.0])
    p = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=1))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]
    p = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=0.1))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_extreme_logits_at_the_extreme_temperatures_give_a_distribution():
    from starjar.spec.sampling import GREEDY_BELOW, MAX_TEMPERATURE

    big = torch.finfo(torch.float32).max
    logits = torch.tensor([big, -big, 0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30])
    for temperature in (GREEDY_BELOW, 1.0, MAX_TEMPERATURE):
        for cut in ({}, {"top_k": 3}, {"top_p": 0.5}, {"top_k": 1}):
            p = logits_to_probs(logits, SamplingParams(temperature=temperature, **cut))
            assert bool(torch.isfinite(p).all()) and abs(float(p.sum()) - 1) < 1e-5, (temperature, cut, p)
            assert float(p[0] + p[3]) > 0.99, (temperature, cut, p)  # the two largest logits hold the mass


def test_top_k_1_is_greedy_at_every_accepted_temperature(models):
    from starjar.spec.sampling import GREEDY_BELOW, MAX_TEMPERATURE

    tok = models["llama"].tokenizer
    prompts = [tok(t)["input_ids"] for t in ("The lighthouse keeper", "Write a haiku about rain")]
    eng = colocated_engine(models["llama"], None, 0, 4)
    want = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    for temperature in (GREEDY_BELOW, 1.0, 30.0, MAX_TEMPERATURE):
        params = SamplingParams(max_tokens=16, temperature=temperature, top_k=1, seed=3, ignore_eos=True)
        assert [r.output_ids for r in eng.generate(prompts, params)] == want, temperature


def _post(port: int, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json",
                                                                     **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("raw,param,sent", [
    (b'"temperature": 1e400', "temperature", "inf"),  # JSON's largest numbers are inf to Python
    (b'"temperature": Infinity', "temperature", "inf"),
    (b'"temperature": 1e39', "temperature", "1e+39"),
    (b'"temperature": 100.5', "temperature", "100.5"),
    (b'"top_p": 1e-300', "top_p", "1e-300"),
])
def test_http_refuses_absurd_sampling_values_naming_what_was_sent(front_end, caplog, raw, param, sent):
    body = b'{"prompt": "hi", "max_tokens": 4, ' + raw + b"}"
    status, out = _post(front_end.http_port, body, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400 and out["error"]["param"] == param, out
    assert f"(got {sent})" in out["error"]["message"], out
    assert not _errors(caplog)


def _grpc_generate(address: str, sampling: gen_pb.SamplingParams) -> grpc.RpcError:
    req = gen_pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling)
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=gen_pb.GenerateRequest.SerializeToString,
                               response_deserializer=gen_pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(req, timeout=60, metadata=AUTH))
    return err.value


@pytest.mark.parametrize("temperature", [float("inf"), 1e39, 101.0])
def test_grpc_refuses_absurd_temperatures_on_the_front_end_and_the_worker(front_end, worker, temperature):
    for address in (f"127.0.0.1:{front_end.grpc_port}", worker):
        err = _grpc_generate(address, gen_pb.SamplingParams(max_tokens=4, temperature=temperature, top_k=1,
                                                            seed=1))
        assert err.code() == SC.INVALID_ARGUMENT and "invalid temperature" in err.details(), (address, err)
        assert "<= 100" in err.details()


def test_grpc_names_the_top_p_that_arrived(front_end):
    err = _grpc_generate(f"127.0.0.1:{front_end.grpc_port}", gen_pb.SamplingParams(max_tokens=4, top_p=1e-40))
    # float32 keeps 1e-40 as a subnormal: that is what arrived, and what the message shows
    assert err.code() == SC.INVALID_ARGUMENT and "invalid top_p" in err.details() and "e-41" in err.details()


# ---- an Authorization header that is not UTF-8 ----------------------------------------------------------

def _raw_http(port: int, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are (http.client would refuse a header that is not latin-1 text) and read the
    status line and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


BAD_HEADERS = [b"Bearer \xe9", b"Bearer " + TOKEN.encode() + b"\xe9", b"Bearer \xff\xfe" + TOKEN.encode(),
               b"Bearer " + TOKEN.encode()[:-1] + b"\xc3"]


@pytest.mark.parametrize("header", BAD_HEADERS)
def test_a_non_utf8_authorization_header_is_a_401_on_the_openai_endpoint(front_end, caplog, header):
    body = b'{"prompt": "hi", "max_tokens": 2}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Authorization: " + header + b"\r\nContent-Length: " + str(len(body)).encode()
               + b"\r\nConnection: close\r\n\r\n" + body)
    status, out = _raw_http(front_end.http_port, request)
    assert status == 401, out[:300]
    assert json.loads(out)["error"]["type"] == "authentication_error"
    assert not _errors(caplog)


@pytest.mark.parametrize("header", BAD_HEADERS)
def test_a_non_utf8_authorization_header_is_a_401_on_a_metrics_port(header):
    from starjar.service.metrics import new_registry, serve

    port = serve(new_registry("hostile"), "127.0.0.1", 0, token=TOKEN)
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + header + b"\r\nConnection: close\r\n\r\n"
    assert _raw_http(port, request)[0] == 401
    ok = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n" \
         b"Connection: close\r\n\r\n"
    assert _raw_http(port, ok)[0] == 200


def test_token_matches_takes_any_text():
    for header in ("Bearer \udce9", f"Bearer {TOKEN}\udce9", "Bearer \ud800", "Bearer é", f"Bearer {TOKEN}é",
                   "Bearer \x00", f"Bearer {TOKEN}\x00"):
        assert token_matches(header, TOKEN) is False, header
    assert token_matches(f"Bearer {TOKEN}", TOKEN) and token_matches("Bearer \udce9", None)
    assert token_matches("Bearer é" + "x" * 20, "é" + "x" * 20)  # a token that is not ASCII still matches itself


# ---- bytes that are not the method's protobuf ------------------------------------------------------------

def _truncated(msg) -> bytes:
    raw = msg.SerializeToString()
    return raw[: len(raw) // 2]


GARBAGE = {"bad-tag": b"\xff\xff\xff\xff\xff", "truncated": _truncated(gen_pb.GenerateRequest(
    prompt="a prompt long enough to cut in the middle of its string", sampling=gen_pb.SamplingParams(top_p=0.5)))}


def _raw_rpc(address: str, method: str, body: bytes, kind: str = "unary_unary", metadata=()) -> grpc.RpcError:
    """Call `method` with `body` as the serialized request, bytes as they are."""
    with grpc.insecure_channel(address) as ch:
        call = getattr(ch, kind)(method)  # no serializers: the bytes go out untouched
        with pytest.raises(grpc.RpcError) as err:
            if kind == "unary_unary":
                call(body, timeout=60, metadata=metadata)
            elif kind == "unary_stream":
                list(call(body, timeout=60, metadata=metadata))
            else:
                list(call(iter([body]), timeout=60, metadata=metadata))
    return err.value


def _assert_refused(err: grpc.RpcError, message: str) -> None:
    assert err.code() == SC.INVALID_ARGUMENT, (err.code(), err.details())
    assert f"not a valid {message}" in err.details() and "DecodeError" not in err.details(), err.details()


@pytest.mark.parametrize("garbage", list(GARBAGE), ids=list(GARBAGE))
def test_corrupt_protobuf_to_the_front_end_and_a_worker_is_invalid_argument_after_the_token(
        front_end, worker, caplog, garbage):
    for address in (f"127.0.0.1:{front_end.grpc_port}", worker):
        err = _raw_rpc(address, GENERATE, GARBAGE[garbage], "unary_stream")
        assert err.code() == SC.UNAUTHENTICATED, (address, err.code(), err.details())  # no token: not parsed
        err = _raw_rpc(address, GENERATE, GARBAGE[garbage], "unary_stream", AUTH)
        _assert_refused(err, "starjar.v1.GenerateRequest")
    assert not _errors(caplog)


@pytest.mark.parametrize("garbage", list(GARBAGE), ids=list(GARBAGE))
def test_corrupt_protobuf_to_the_draft_server_is_invalid_argument_after_the_token(models, caplog, garbage):
    with BackgroundDraftServer(models["draft"], security=Security(token=TOKEN)) as srv:
        # GetStatsRequest has no fields: its garbage is an unknown length-delimited field cut short
        for method, name, body in (("Attach", "AttachRequest", GARBAGE[garbage]),
                                   ("Release", "ReleaseRequest", GARBAGE[garbage]),
                                   ("GetStats", "GetStatsRequest", b"\x0a\x05ab")):
            err = _raw_rpc(srv.address, f"/starjar.v1.DraftService/{method}", body)
            assert err.code() == SC.UNAUTHENTICATED, (method, err.code(), err.details())
            _assert_refused(_raw_rpc(srv.address, f"/starjar.v1.DraftService/{method}", body, metadata=AUTH),
                            f"starjar.v1.{name}")
        # Speculate: a stream of an attached target whose first round is not a SpeculateRequest
        stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(srv.address))
        tag = stub.Attach(draft_pb2.AttachRequest(worker_id="w", fingerprint=fingerprint(models["llama"])),
                          metadata=AUTH).tag
        speculate = "/starjar.v1.DraftService/Speculate"
        err = _raw_rpc(srv.address, speculate, GARBAGE[garbage], "stream_stream",
                       (("starjar-tag", tag.hex()),))
        assert err.code() == SC.UNAUTHENTICATED, (err.code(), err.details())
        err = _raw_rpc(srv.address, speculate, GARBAGE[garbage], "stream_stream",
                       (*AUTH, ("starjar-tag", tag.hex())))
        _assert_refused(err, "starjar.v1.SpeculateRequest")
        assert stub.GetStats(draft_pb2.GetStatsRequest(), metadata=AUTH) is not None  # the server still serves
    assert not _errors(caplog)
