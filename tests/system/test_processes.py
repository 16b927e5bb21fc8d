"""Real processes on loopback: `starjar serve draft` + three `starjar serve target`, used through the SDK."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.launch import ServerProcess
from starjar import Client, InvalidRequest

N_REQUESTS = 50
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(model_dirs):
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    targets = [ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address, "--port", "0",
                             "--gamma", "3", "--batch-size", "8", "--worker-id", f"t{k}") for k in range(3)]
    yield draft, targets
    for p in targets + [draft]:
        p.kill()


def run_requests(address, prompts, max_tokens=MAX_TOKENS):
    with Client(address, timeout=120) as c, ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: c.generate(prompt_token_ids=p, max_tokens=max_tokens), prompts))


def test_one_draft_three_targets_fifty_requests_each(cluster, prompt_ids, reference):
    _, targets = cluster
    prompts = (prompt_ids * 2)[:N_REQUESTS]
    ref = [r[:MAX_TOKENS] for r in reference("llama", 64)]
    ref = (ref * 2)[:N_REQUESTS]
    results = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, run_requests(targets[k].address, prompts)))
               for k in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for k in range(3):
        assert [r.token_ids for r in results[k]] == ref
        assert all(r.finish_reason in ("stop", "length") and r.usage.completion_tokens == len(r.token_ids)
                   for r in results[k])


def test_target_rejects_bad_requests_and_keeps_serving(cluster, models):
    _, targets = cluster
    with Client(targets[0].address, timeout=30) as c:
        for kw, needle in [(dict(prompt_token_ids=[models["llama"].vocab_size]), "prompt_token_ids"),
                           (dict(prompt_token_ids=[5] * 600), "prompt: at most 511 tokens"),
                           (dict(prompt="hi", model="gpt-17"), "model: unknown model")]:
            with pytest.raises(InvalidRequest) as err:
                c.generate(max_tokens=4, **kw)
            assert needle in err.value.details
        assert c.generate("hello", max_tokens=4).finish_reason in ("stop", "length")


@pytest.mark.chaos
def test_kill_9_draft_server_and_restart(model_dirs, prompt_ids, reference):
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    port = draft.address.rsplit(":", 1)[1]
    targets = [ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address, "--port", "0",
                             "--gamma", "3", "--batch-size", "4", "--worker-id", f"c{k}") for k in range(3)]
    prompts = prompt_ids[:20]
    ref = [r[:MAX_TOKENS] for r in reference("llama", 64)][:20]
    results, errors = {}, []

    def run(k):
        try:
            results[k] = run_requests(targets[k].address, prompts)
        except Exception as exc:  # any failure counts
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    [t.start() for t in threads]
    time.sleep(1.0)
    draft.kill()  # SIGKILL: no goodbye
    time.sleep(0.5)
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", port)
    [t.join() for t in threads]
    try:
        assert not errors
        for k in range(3):
            assert [r.token_ids for r in results[k]] == ref
    finally:
        for p in targets + [draft]:
            p.kill()


def test_sigterm_drains_and_exits_cleanly(model_dirs, models):
    import grpc

    from starjar.spec.proposer import DraftRequest
    from starjar.v1 import draft_pb2 as pb
    from starjar.v1 import draft_pb2_grpc as pb_grpc
    from target_worker.remote.client import RemoteProposer

    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    rp = RemoteProposer(draft.address, models["llama"].fingerprint, "graceful", deadline_s=10)
    assert rp.wait_attached(10)
    assert rp.propose([DraftRequest("s", 0, [5, 6, 7], 3)])[0]  # a round answered before the signal
    assert draft.terminate() == 0  # SIGTERM: finish what is in flight, refuse new work, exit 0
    with pytest.raises(grpc.RpcError):
        pb_grpc.DraftServiceStub(grpc.insecure_channel(draft.address)).Attach(
            pb.AttachRequest(worker_id="late"), timeout=2)
    rp.close()


def _live_draft_sequences(address):
    import grpc

    from starjar.v1 import draft_pb2 as pb
    from starjar.v1 import draft_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10).live_sequences


def test_streaming_and_cancellation_free_the_draft_session(cluster, prompt_ids, reference):
    draft, targets = cluster
    with Client(targets[1].address, timeout=60) as c:
        chunks = list(c.generate_stream(prompt_token_ids=prompt_ids[0], max_tokens=MAX_TOKENS))
        assert chunks[-1].finish_reason in ("stop", "length") and all(ch.finish_reason is None for ch in chunks[:-1])
        assert [t for ch in chunks for t in ch.token_ids] == reference("llama", 64)[0][:MAX_TOKENS]
        # Walk away after two chunks of a long request: the target and the draft server let go.
        stream = c.generate_stream(prompt_token_ids=prompt_ids[1], max_tokens=400, ignore_eos=True)
        next(stream), next(stream)
        assert _live_draft_sequences(draft.address) >= 1
        stream.close()
        deadline = time.time() + 2.0
        while time.time() < deadline and _live_draft_sequences(draft.address):
            time.sleep(0.05)
        assert _live_draft_sequences(draft.address) == 0
        assert c.generate("still serving", max_tokens=4).usage.completion_tokens >= 1


def test_async_client(cluster, prompt_ids, reference):
    import asyncio

    from starjar import AsyncClient

    async def main():
        async with AsyncClient(cluster[1][2].address, timeout=60) as c:
            results = await asyncio.gather(*[c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS)
                                             for p in prompt_ids[:6]])
            return [r.token_ids for r in results]

    assert asyncio.run(main()) == [r[:MAX_TOKENS] for r in reference("llama", 64)[:6]]
