"""Real processes on loopback: `starjar serve draft` + three `starjar serve target`, used through the SDK."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from starjar import Client, InvalidRequest
from controller.launch import ServerProcess

N_REQUESTS = 50
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(model_dirs):
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    targets = [ServerProcess("target", "--model", model_dirs["llama"], "--draft", draft.address, "--port", "0",
                             "--gamma", "3", "--batch-size", "8", "--worker-id", f"t{k}") for k in range(3)]
    yield draft, targets
    for p in targets + [draft]:
        p.kill()


def run_requests(address, prompts, max_tokens=MAX_TOKENS):
    with Client(address, timeout=120) as c, ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: c.generate(prompt_token_ids=p, max_tokens=max_tokens), prompts))


def test_one_draft_three_targets_fifty_requests_each(cluster, spec_prompts, reference):
    _, targets = cluster
    prompts = (spec_prompts * 2)[:N_REQUESTS]
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
def test_kill_9_draft_server_and_restart(model_dirs, spec_prompts, reference):
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    port = draft.address.rsplit(":", 1)[1]
    targets = [ServerProcess("target", "--model", model_dirs["llama"], "--draft", draft.address, "--port", "0",
                             "--gamma", "3", "--batch-size", "4", "--worker-id", f"c{k}") for k in range(3)]
    prompts = spec_prompts[:20]
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

    from starjar.v1 import draft_pb2 as pb
    from starjar.v1 import draft_pb2_grpc as pb_grpc
    from target_worker.draft_client import RemoteProposer
    from starjar.proposer import DraftRequest

    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    rp = RemoteProposer(draft.address, models["llama"].fingerprint, "graceful", deadline_s=10)
    assert rp.wait_attached(10)
    assert rp.propose([DraftRequest("s", 0, [5, 6, 7], 3)])[0]  # a round answered before the signal
    assert draft.terminate() == 0  # SIGTERM: finish what is in flight, refuse new work, exit 0
    with pytest.raises(grpc.RpcError):
        pb_grpc.DraftServiceStub(grpc.insecure_channel(draft.address)).Attach(
            pb.AttachRequest(worker_id="late"), timeout=2)
    rp.close()
