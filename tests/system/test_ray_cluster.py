"""`starjar up` on loopback (real Ray, real gRPC, real HTTP, tiny models): the public API end to end.

One cluster for the module: a draft server, two target workers and the front
end, started and stopped by the CLI exactly as a user does. The test process
also joins the Ray cluster as a driver, to read the actors' counters and to
kill the draft server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_cli import cli
from streams import Stream, refused_while_draining, wait_streaming

from benchmarks.api import mixed_clients
from starjar import Client
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc

MAX_TOKENS = 24
N_REQUESTS = 100


@pytest.fixture(scope="module")
def cluster(model_dirs, tmp_path_factory):
    home = tmp_path_factory.mktemp("starjar_home")
    env = dict(os.environ, STARJAR_HOME=str(home))
    up = cli("up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--targets", "2",
              "--gamma", "3", "--batch-size", "8", "--grpc-port", "0", "--http-port", "0", "--json", env=env)
    assert up.returncode == 0, up.stderr[-3000:]
    addrs = json.loads(up.stdout.strip().splitlines()[-1])
    state = json.loads((home / "run" / "cluster.json").read_text())
    yield {"addrs": addrs, "state": state, "env": env, "home": home}
    import ray

    if ray.is_initialized():
        ray.shutdown()
    cli("down", env=env, timeout=120)


@pytest.fixture(scope="module")
def controller(cluster):
    import ray

    from controller.cluster.spec import CONTROLLER, NAMESPACE, local_ray_env

    local_ray_env(cluster["home"] / "run")  # this cluster's Ray token
    ray.init(address=cluster["state"]["ray_address"], namespace=NAMESPACE, log_to_driver=False)
    return ray.get_actor(CONTROLLER, namespace=NAMESPACE)


def _ref(reference, n):
    ref = [r[:MAX_TOKENS] for r in reference("llama", 64)]
    return (ref * (n // len(ref) + 1))[:n]


def test_hundred_requests_from_eight_sdk_clients_match_the_target_alone(cluster, controller, prompt_ids,
                                                                        reference):
    import ray

    prompts = (prompt_ids * 3)[:N_REQUESTS]
    results = mixed_clients(cluster["addrs"]["grpc"], prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == _ref(reference, N_REQUESTS)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    stats = ray.get(controller.target_stats.remote())
    assert all(s["decode_steps"] > 0 for s in stats.values()), "both workers served"
    assert sum(s["drafted_tokens"] for s in stats.values()) > 0, "speculation ran through the draft server"


def _http(url: str, body: bytes | dict | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _sse(raw: bytes) -> list:
    events = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_openai_endpoint_gives_the_sdk_text(cluster):
    http, prompt = cluster["addrs"]["http"], "The quick brown fox"
    with Client(cluster["addrs"]["grpc"], timeout=60) as c:
        sdk = c.generate(prompt, max_tokens=MAX_TOKENS)
        sdk_chat = c.generate(prompt, max_tokens=MAX_TOKENS, chat=True)

    status, raw = _http(f"{http}/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200
    body = json.loads(raw)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == sdk.text
    assert body["usage"]["completion_tokens"] == len(sdk.token_ids)

    status, raw = _http(f"{http}/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   "stream": True, "stream_options": {"include_usage": True}})
    chunks = _sse(raw)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == sdk.text
    assert chunks[-1]["usage"]["completion_tokens"] == len(sdk.token_ids)

    msgs = [{"role": "user", "content": prompt}]
    status, raw = _http(f"{http}/v1/chat/completions", {"messages": msgs, "max_tokens": MAX_TOKENS,
                                                        "temperature": 0})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == sdk_chat.text
    status, raw = _http(f"{http}/v1/chat/completions", {"messages": msgs, "max_tokens": MAX_TOKENS,
                                                        "temperature": 0, "stream": True})
    chunks = _sse(raw)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == sdk_chat.text

    status, raw = _http(f"{http}/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "llama"
    assert _http(f"{http}/health")[0] == 200


def test_stop_strings_cut_the_text(cluster):
    http = cluster["addrs"]["http"]
    with Client(cluster["addrs"]["grpc"], timeout=60) as c:
        full = c.generate("The quick brown fox", max_tokens=MAX_TOKENS, ignore_eos=True).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop and stop in full
    for stream in (False, True):
        status, raw = _http(f"{http}/v1/completions", {"prompt": "The quick brown fox", "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True, "stop": [stop],
                                                       "stream": stream})
        assert status == 200
        if stream:
            chunks = _sse(raw)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            body = json.loads(raw)
            choice = body["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
            assert 0 < body["usage"]["completion_tokens"] <= MAX_TOKENS and body["usage"]["prompt_tokens"] > 0
        assert text == full[: full.index(stop)] and finish == "stop"


def _counts(controller) -> tuple[int, int]:
    """(requests running or waiting on the target workers, sequences live on the draft server)."""
    import ray

    from controller.cluster.spec import NAMESPACE
    from controller.fleet.names import DRAFT

    targets = ray.get(controller.target_stats.remote())
    draft = ray.get(ray.get_actor(DRAFT, namespace=NAMESPACE).stats.remote())
    return sum(s["running"] + s["waiting"] for s in targets.values()), int(draft["live_sequences"])


def test_cancelling_a_stream_frees_the_target_sequence_and_the_draft_session(cluster, controller, prompt_ids):
    base = (0, 0)
    t0 = time.time()  # a stop-string request of the previous test may still be being cancelled
    while _counts(controller) != base and time.time() - t0 < 2.0:
        time.sleep(0.05)
    assert _counts(controller) == base
    with Client(cluster["addrs"]["grpc"], timeout=120) as c:
        stream = c.generate_stream(prompt_token_ids=prompt_ids[0], max_tokens=300, ignore_eos=True)
        got = [next(stream) for _ in range(3)]
        assert sum(len(g.token_ids) for g in got) >= 3
        busy = _counts(controller)
        assert busy[0] == 1 and busy[1] == 1, busy
        stream.close()  # the caller walks away mid-stream
        t0 = time.time()
        while _counts(controller) != base and time.time() - t0 < 2.0:
            time.sleep(0.05)
        assert _counts(controller) == base, f"not freed within 2 s: {_counts(controller)}"


def _raw_generate(address: str, req: pb.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.GenerateServiceStub(ch).Generate(req, timeout=30))
    return err.value


def test_bad_requests_name_the_field(cluster, models):
    g, http = cluster["addrs"]["grpc"], cluster["addrs"]["http"]
    cases = [(pb.GenerateRequest(prompt="hi", model="gpt-17"), "model"),
             (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=-3)), "max_tokens"),
             (pb.GenerateRequest(prompt_token_ids=[5] * 600), "prompt"),
             (pb.GenerateRequest(), "prompt")]
    for req, field in cases:
        err = _raw_generate(g, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and f"invalid {field}" in err.details()
    http_cases = [({"prompt": "hi", "model": "gpt-17"}, "model"), ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
                  ({"prompt": [5] * 600}, "prompt"), (b"{not json", "body"), ({"prompt": 7}, "prompt"),
                  ({"prompt": "hi", "temperature": "hot"}, "temperature"), ({"prompt": "hi", "n": 3}, "n")]
    for body, field in http_cases:
        status, raw = _http(f"{http}/v1/completions", body)
        assert status == 400, (body, raw)
        err = json.loads(raw)["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error", err
    status, raw = _http(f"{http}/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages[0].role"
    with Client(g, timeout=30) as c:  # still serving
        assert c.generate("hello", max_tokens=4).finish_reason in ("stop", "length")


def _draft_info(controller) -> dict:
    import ray

    return ray.get(controller.status.remote())["actors"]["starjar-draft"]


def _wait_reattached(controller, old_pid: int, timeout: float = 120.0) -> dict:
    import ray

    t0 = time.time()
    while time.time() - t0 < timeout:
        st = ray.get(controller.status.remote())
        draft = st["actors"]["starjar-draft"]
        targets = [a for n, a in st["actors"].items() if n.startswith("starjar-target")]
        if draft["live"] and draft["pid"] != old_pid and all(a.get("draft_attached") for a in targets):
            return st
        time.sleep(0.2)
    raise AssertionError(f"draft server not found again: {ray.get(controller.status.remote())}")


@pytest.mark.parametrize("how", ["ray.kill", "kill -9"])
def test_draft_server_killed_mid_run_loses_nothing(cluster, controller, prompt_ids, reference, how):
    import ray

    before = _draft_info(controller)
    prompts = (prompt_ids * 2)[:48]
    results, errors = [None] * len(prompts), []

    def lane(idx):
        try:
            with Client(cluster["addrs"]["grpc"], timeout=180) as c:
                for i in idx:
                    results[i] = c.generate(prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS)
        except Exception as exc:  # noqa: BLE001 - any failure is the test's failure
            errors.append(exc)

    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(lane, list(range(k, len(prompts), 6))) for k in range(6)]
        time.sleep(1.0)  # mid-run
        if how == "ray.kill":
            ray.kill(ray.get_actor("starjar-draft", namespace="starjar"), no_restart=False)
        else:
            os.kill(before["pid"], signal.SIGKILL)
        [f.result() for f in futs]
    assert not errors
    assert [r.token_ids for r in results] == _ref(reference, len(prompts))
    st = _wait_reattached(controller, before["pid"])
    assert st["restarts"].get("starjar-draft", 0) >= 1
    # And speculation works again through the restarted server.
    drafted = sum(s["drafted_tokens"] for s in ray.get(controller.target_stats.remote()).values())
    with Client(cluster["addrs"]["grpc"], timeout=60) as c:
        out = [c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS).token_ids for p in prompt_ids[:4]]
    assert out == _ref(reference, 4)
    assert sum(s["drafted_tokens"] for s in ray.get(controller.target_stats.remote()).values()) > drafted


def test_down_drains_generations_in_flight_then_leaves_no_process_behind(cluster, controller, long_prompts):
    """`starjar down` while 24 long generations are in flight (16 streaming, 8 queued): they all finish as the
    target alone writes them, new requests are refused meanwhile (gRPC UNAVAILABLE "draining", HTTP 503), then
    every process is gone."""
    import psutil
    import ray

    prompts, refs = long_prompts
    keeper = cluster["state"]["keeper_pid"]
    pids = {keeper, *cluster["state"]["pids"], *(p.pid for p in psutil.Process(keeper).children(recursive=True))}
    streams = [Stream(cluster["addrs"]["grpc"], prompts[k % 2], 300) for k in range(24)]  # 2 workers x batch 8
    wait_streaming(streams, n=16)
    t0 = time.time()
    while _counts(controller)[0] < len(streams):  # every request reached a worker before `down`
        assert time.time() - t0 < 30, _counts(controller)
        time.sleep(0.05)
    ray.shutdown()
    down = subprocess.Popen([sys.executable, "-m", "controller.cli.main", "down"], env=cluster["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    refused = refused_while_draining(cluster["addrs"]["grpc"], timeout=30)
    assert "draining" in refused.details, refused.details
    status, raw = _http(f"{cluster['addrs']['http']}/v1/completions", {"prompt": "probe", "max_tokens": 1})
    assert status == 503 and b"draining" in raw, (status, raw)
    assert not all(s.finish_reason for s in streams), "every stream was done before the refusals: no drain seen"

    for s in streams:
        s.join(180)
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.tokens for s in streams] == [refs[k % 2] for k in range(len(streams))]
    out, err = down.communicate(timeout=180)
    assert down.returncode == 0, err
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, [psutil.Process(p).cmdline() for p in alive]
    assert not (cluster["home"] / "run" / "cluster.json").exists()
