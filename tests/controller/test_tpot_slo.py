"""A TPOT SLO per request, end to end: the SDK and the OpenAI endpoint send it, the worker checks it and
reports the achieved TPOT and whether the SLO held on the last message; output is unchanged."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from fault_servers import Worker

from controller.frontend.server import FrontEnd
from starjar import Client
from starjar.client import InvalidRequest


@pytest.fixture(scope="module")
def worker(models):
    w = Worker(models["llama"], "slo", batch_size=2)
    yield w
    w.close()


def test_sdk_tpot_slo_is_reported(worker, prompt_ids, reference):
    ref = reference("llama")[0][:16]
    with Client(worker.address, timeout=60) as c:
        loose = c.generate(prompt_token_ids=prompt_ids[0], max_tokens=16, tpot_slo_s=100.0)
        tight = c.generate(prompt_token_ids=prompt_ids[0], max_tokens=16, tpot_slo_s=1e-9)
        none = c.generate(prompt_token_ids=prompt_ids[0], max_tokens=16)
    assert loose.token_ids == tight.token_ids == none.token_ids == ref
    assert loose.tpot_s > 0 and loose.tpot_slo_met is True
    assert tight.tpot_slo_met is False and none.tpot_slo_met is None and none.tpot_s > 0


def test_sdk_rejects_a_bad_tpot_slo(worker, prompt_ids):
    with Client(worker.address, timeout=60) as c, pytest.raises(InvalidRequest, match="tpot_slo_s"):
        c.generate(prompt_token_ids=prompt_ids[0], max_tokens=4, tpot_slo_s=-1.0)


def _post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_openai_extension_field(models, worker, prompt_ids):
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    try:
        fe.set_targets({"slo": worker.address})
        url = f"http://127.0.0.1:{fe.http_port}/v1/completions"
        status, body = _post(url, {"model": "llama", "prompt": prompt_ids[0], "max_tokens": 8, "tpot_slo_s": 50})
        assert status == 200 and body["usage"]["tpot_slo_met"] is True and body["usage"]["tpot_s"] > 0
        status, body = _post(url, {"model": "llama", "prompt": prompt_ids[0], "max_tokens": 8, "tpot_slo_s": 0})
        assert status == 400 and body["error"]["param"] == "tpot_slo_s"
    finally:
        fe.stop()
