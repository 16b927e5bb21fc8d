"""Per-request control of speculation end to end: a real draft server, a target worker drafting through it and
the front end, over gRPC (SDK and raw stubs) and the OpenAI endpoint. A request's speculation.max_draft_tokens
caps the drafts verified for it per step (0: none), its usage counts them, its greedy output is the target's
own, and a bad cap is refused naming the field and the limit."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from fault_servers import Worker, own_copy

from controller.frontend.server import FrontEnd
from draft_server.background import BackgroundDraftServer
from starjar import Client
from starjar.client import InvalidRequest
from starjar.service.status import error_field
from starjar.spec.draft_cap import FIELD, MAX_DRAFT_TOKENS
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc

N_TOKENS = 24
LIMIT = f"[0, {MAX_DRAFT_TOKENS}]"
BAD_VALUES = [-1, MAX_DRAFT_TOKENS + 1, 1.5, "x", True]


@pytest.fixture(scope="module")
def cluster(models):
    """The target as its own draft (every draft accepted): a step drafts exactly its gamma (4 by default)."""
    draft = BackgroundDraftServer(own_copy(models["llama"])).start()
    worker = Worker(models["llama"], "cap", batch_size=4, draft_server=draft.address, draft_deadline_s=10.0)
    assert worker.server.proposer.wait_attached(30)
    fe = FrontEnd("llama", models["llama"].tokenizer).start()
    fe.set_targets({"cap": worker.address})
    yield worker, fe
    fe.stop(0.5)
    worker.close()
    draft.stop()


@pytest.fixture(scope="module")
def cases(prompt_ids, reference):
    """Two prompts whose reference output runs N_TOKENS tokens or more, and those tokens."""
    refs = reference("llama")
    picked = [i for i, ref in enumerate(refs) if len(ref) >= N_TOKENS][:2]
    return [(prompt_ids[i], refs[i][:N_TOKENS]) for i in picked]


def _bounded(usage) -> bool:
    """Every step drafted at most one token: a step emits its accepted drafts and one token of the target's,
    after the prefill's first token, so drafted + accepted <= completion - 1 (cap 2 with every draft accepted
    would make it 4 per 3 tokens)."""
    return usage.draft_tokens + usage.accepted_draft_tokens <= usage.completion_tokens - 1


@pytest.mark.parametrize("via", ["front end", "worker"])
def test_sdk_caps_keep_the_output_and_usage_counts_drafts(cluster, cases, via):
    worker, fe = cluster
    address = f"127.0.0.1:{fe.grpc_port}" if via == "front end" else worker.address
    with Client(address, timeout=120) as c:
        for prompt, ref in cases:
            free, off, one = (c.generate(prompt_token_ids=prompt, max_tokens=N_TOKENS, speculation=spec)
                              for spec in (None, {"max_draft_tokens": 0}, {"max_draft_tokens": 1}))
            assert free.token_ids == off.token_ids == one.token_ids == ref
            assert off.usage.draft_tokens == off.usage.accepted_draft_tokens == 0
            assert 0 < one.usage.draft_tokens and _bounded(one.usage), one.usage
            assert free.usage.draft_tokens > 0 and not _bounded(free.usage), free.usage
            assert {free.usage.completion_tokens, off.usage.completion_tokens, one.usage.completion_tokens} == \
                {N_TOKENS}


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_sdk_refuses_a_bad_cap_naming_the_field(cluster, bad):
    _, fe = cluster
    with Client(f"127.0.0.1:{fe.grpc_port}", timeout=60) as c:
        with pytest.raises(InvalidRequest, match=r"\[0, 16\]") as err:
            c.generate("hi", max_tokens=4, speculation={"max_draft_tokens": bad})
    assert err.value.field == FIELD


@pytest.mark.parametrize("spec", [{"max_drafts": 2}, {"max_draft_tokens": 2, "tree": 1}, 3, [1]])
def test_sdk_refuses_unknown_keys_and_non_objects(cluster, spec):
    _, fe = cluster
    with Client(f"127.0.0.1:{fe.grpc_port}", timeout=60) as c:
        with pytest.raises(InvalidRequest, match="speculation") as err:
            c.generate("hi", max_tokens=4, speculation=spec)
    assert err.value.field == "speculation"


@pytest.mark.parametrize("value", [-1, MAX_DRAFT_TOKENS + 1, -(2**31)])
@pytest.mark.parametrize("via", ["front end", "worker"])
def test_the_servers_refuse_an_out_of_range_cap(cluster, value, via):
    """What no SDK check stops: the raw message, to the front end and to a worker on its own."""
    worker, fe = cluster
    address = f"127.0.0.1:{fe.grpc_port}" if via == "front end" else worker.address
    req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4),
                             speculation=pb.Speculation(max_draft_tokens=value))
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerateServiceStub(channel).Generate(req, timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_field(err.value) == FIELD and LIMIT in err.value.details()


def _post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _sse_usage(raw: str) -> dict:
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return events[-1]["usage"]


def test_openai_caps_keep_the_text_and_usage_counts_drafts(cluster, cases):
    _, fe = cluster
    url = f"http://127.0.0.1:{fe.http_port}/v1/completions"
    prompt, _ = cases[0]
    texts, usages = [], []
    for spec in (None, {"max_draft_tokens": 0}, {"max_draft_tokens": 1}):
        body = {"prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0} | ({"speculation": spec} if spec else {})
        status, raw = _post(url, body)
        assert status == 200, raw
        out = json.loads(raw)
        texts.append(out["choices"][0]["text"])
        usages.append(out["usage"])
    assert texts[0] == texts[1] == texts[2]
    free, off, one = usages
    assert off["draft_tokens"] == off["accepted_draft_tokens"] == 0
    assert 0 < one["draft_tokens"] and one["draft_tokens"] + one["accepted_draft_tokens"] <= N_TOKENS - 1
    assert free["draft_tokens"] + free["accepted_draft_tokens"] > N_TOKENS - 1
    chat = f"http://127.0.0.1:{fe.http_port}/v1/chat/completions"
    status, raw = _post(chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
                               "stream_options": {"include_usage": True}, "speculation": {"max_draft_tokens": 0}})
    assert status == 200 and _sse_usage(raw)["draft_tokens"] == 0, raw


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("spec,param,needle", [({"max_draft_tokens": v}, FIELD, LIMIT) for v in BAD_VALUES] + [
    ({"max_drafts": 2}, "speculation", "max_drafts"), ("4", "speculation", "object")])
def test_openai_refuses_a_bad_cap_naming_the_field(cluster, path, spec, param, needle):
    _, fe = cluster
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "speculation": spec}
    if path.endswith("chat/completions"):
        del body["prompt"]
    else:
        del body["messages"]
    status, raw = _post(f"http://127.0.0.1:{fe.http_port}{path}", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and needle in err["message"], raw
    assert err["type"] == "invalid_request_error"
