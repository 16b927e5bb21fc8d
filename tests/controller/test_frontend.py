"""The front end in-process over real gRPC and HTTP: auth, routing around a dead worker, health."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from controller.frontend.server import FrontEnd
from starjar import Client, Unauthenticated
from starjar.service.serving import BackgroundLoop
from target_worker.config import TargetWorkerConfig
from target_worker.server import TargetServer


@pytest.fixture(scope="module")
def worker(models):
    loop = BackgroundLoop("test-target")
    server = TargetServer(models["llama"], TargetWorkerConfig(worker_id="w0"))
    loop.run(server.start())
    yield f"127.0.0.1:{server.port}"
    loop.run(server.stop(0.5))
    loop.stop()


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


def _http(url, body=None, token=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_bearer_token_guards_grpc_and_http(models, worker):
    fe = FrontEnd("llama", models["llama"].tokenizer, auth_token="s3cret").start()
    try:
        fe.set_targets({"w0": worker})
        grpc_addr, http = f"127.0.0.1:{fe.grpc_port}", f"http://127.0.0.1:{fe.http_port}"
        with Client(grpc_addr, timeout=30) as c:
            with pytest.raises(Unauthenticated):
                c.generate("hi", max_tokens=4)
        with Client(grpc_addr, timeout=30, auth_token="wrong") as c:
            with pytest.raises(Unauthenticated):
                c.generate("hi", max_tokens=4)
        with Client(grpc_addr, timeout=30, auth_token="s3cret") as c:
            assert c.generate("hi", max_tokens=4).finish_reason in ("stop", "length")
        status, body = _http(f"{http}/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, body = _http(f"{http}/v1/completions", {"prompt": "hi", "max_tokens": 4}, token="s3cret")
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        fe.stop(0.5)


def test_requests_route_around_a_dead_worker_and_health_follows(models, worker, prompt_ids, reference):
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        http = f"http://127.0.0.1:{fe.http_port}"
        assert _http(f"{http}/health")[0] == 503  # no worker yet
        fe.set_targets({"dead": _dead_address(), "w0": worker})
        assert _http(f"{http}/health")[0] == 200
        with Client(f"127.0.0.1:{fe.grpc_port}", timeout=60) as c:
            outs = [c.generate(prompt_token_ids=p, max_tokens=16).token_ids for p in prompt_ids[:6]]
        assert outs == [r[:16] for r in reference("llama", 64)[:6]]
        assert fe.in_flight() == {"dead": 0, "w0": 0}
    finally:
        fe.stop(0.5)


def _raw_post(url: str, raw: bytes):
    req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("raw,param,needle", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 4}', "body", "surrogate"),  # valid JSON, not text
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "body", "malformed JSON"),  # past 4300 digits
    (b"[" * 100000 + b"]" * 100000, "body", "malformed JSON"),  # nesting deeper than the parser recurses
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": 1' + b"0" * 400 + b"}", "temperature", "finite"),
    (b'{"prompt": "hi", "max_tokens": 4, "top_p": 1' + b"0" * 400 + b"}", "top_p", "finite"),
])
def test_bodies_python_cannot_take_are_400s_naming_the_part(models, worker, caplog, raw, param, needle):
    """Before, each of these was a 500 'internal error' with a traceback in the log."""
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        fe.set_targets({"w0": worker})
        status, out = _raw_post(f"http://127.0.0.1:{fe.http_port}/v1/completions", raw)
        assert status == 400 and out["error"]["param"] == param and needle in out["error"]["message"], out
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        status, out = _raw_post(f"http://127.0.0.1:{fe.http_port}/v1/completions",
                                b'{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 4}')
        assert status == 200  # a surrogate pair is text
    finally:
        fe.stop(0.5)


def test_only_json_bodies_are_accepted_and_top_k_past_int32_is_a_400(models, worker):
    """A page can POST text/plain to a local server without a preflight; that is refused (415).
    top_k above 2^31 names its field (it was a 500)."""
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        fe.set_targets({"w0": worker})
        url = f"http://127.0.0.1:{fe.http_port}/v1/completions"
        body = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            req = urllib.request.Request(url, data=body, headers={"Content-Type": ctype})
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=60)
            assert err.value.code == 415 and json.loads(err.value.read())["error"]["param"] == "Content-Type"
        status, out = _http(url, {"prompt": "hi", "max_tokens": 4, "top_k": 2**40})
        assert status == 400 and out["error"]["param"] == "top_k"
        status, out = _http(url, {"prompt": "hi", "max_tokens": 4})
        assert status == 200
    finally:
        fe.stop(0.5)
