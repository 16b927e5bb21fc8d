"""Draining on SIGTERM, with real processes on loopback: generations in flight when the signal lands finish,
exactly as the target alone would have written them, and new ones are refused at once."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from controller.launch import ServerProcess
from starjar import Client, Unavailable

MAX_TOKENS = 300  # long enough to be mid-stream when the signal lands (no EOS within it for these prompts)
N_STREAMS = 8  # with --batch-size 2: two running, six queued; the queued ones are in flight too


@pytest.fixture(scope="module")
def long_prompts(spec_prompts, models):
    """Two prompts and the target's own greedy continuation of each (Hugging Face generate, batch 1)."""
    from starjar.reference import hf_greedy

    prompts = spec_prompts[:2]
    refs = [hf_greedy(models["llama"], p, MAX_TOKENS) for p in prompts]
    assert all(len(r) == MAX_TOKENS for r in refs), "a prompt whose reference ends early makes a short stream"
    return prompts, refs


class Stream(threading.Thread):
    """One generation streamed on its own thread; `started` is set at its first tokens."""

    def __init__(self, address: str, prompt: list[int]):
        super().__init__(daemon=True)
        self.address, self.prompt = address, prompt
        self.started = threading.Event()
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with Client(self.address, timeout=180) as c:
                for chunk in c.generate_stream(prompt_token_ids=self.prompt, max_tokens=MAX_TOKENS):
                    self.tokens += chunk.token_ids
                    self.finish_reason = chunk.finish_reason or self.finish_reason
                    self.started.set()
        except Exception as exc:  # noqa: BLE001 - any failure is the test's failure
            self.error = exc


def _gauges(metrics_address: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _wait_accepted(metrics_address: str, n: int, timeout: float = 60.0) -> None:
    """Until the worker holds n requests (running or queued): all of them are in flight before the signal."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        g = _gauges(metrics_address)
        if g.get("starjar_target_requests_running", 0) + g.get("starjar_target_requests_waiting", 0) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"the worker never held {n} requests: {_gauges(metrics_address)}")


def _wait_streaming(streams: list[Stream], timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not any(s.tokens for s in streams):
        assert time.time() < deadline, "no stream produced tokens"
        time.sleep(0.01)


def _refused_while_draining(address: str, timeout: float = 10.0) -> Unavailable:
    """Probe with short requests until one is refused; those that got in before the signal must just finish."""
    deadline = time.time() + timeout
    with Client(address, timeout=30) as c:
        while time.time() < deadline:
            try:
                assert c.generate("probe", max_tokens=1).finish_reason in ("stop", "length")
            except Unavailable as exc:
                return exc
            time.sleep(0.01)
    raise AssertionError("new requests were still accepted 10 s after SIGTERM")


def test_sigterm_target_finishes_generations_in_flight_and_refuses_new_ones(model_dirs, long_prompts):
    prompts, refs = long_prompts
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    target = ServerProcess("target", "--model", model_dirs["llama"], "--draft", draft.address, "--port", "0",
                           "--gamma", "3", "--batch-size", "2", "--worker-id", "drain", "--metrics-port", "0",
                           "--drain-timeout", "120")
    try:
        streams = [Stream(target.address, prompts[k % 2]) for k in range(N_STREAMS)]
        _wait_accepted(target.ready["metrics"], N_STREAMS)
        _wait_streaming(streams)
        t_signal = time.time()
        target.proc.send_signal(signal.SIGTERM)

        refused = _refused_while_draining(target.address)
        assert "draining" in refused.details, refused.details
        assert not all(s.finish_reason for s in streams), "every stream was done before the refusal: no drain seen"

        for s in streams:
            s.join(120)
        assert [s.error for s in streams] == [None] * N_STREAMS
        assert [s.tokens for s in streams] == [refs[k % 2] for k in range(N_STREAMS)]
        assert all(s.finish_reason == "length" for s in streams)
        assert target.proc.wait(timeout=60) == 0
        print(f"drained {N_STREAMS} generations in {time.time() - t_signal:.1f} s after SIGTERM")
    finally:
        target.kill()
        draft.kill()


def test_sigterm_draft_server_mid_run_loses_nothing(model_dirs, long_prompts):
    """The draft server holds no generation: on SIGTERM it answers what is queued and goes; the targets' streams
    decode on without drafts, with the same output."""
    prompts, refs = long_prompts
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    target = ServerProcess("target", "--model", model_dirs["llama"], "--draft", draft.address, "--port", "0",
                           "--gamma", "3", "--batch-size", "4", "--worker-id", "drain-d")
    try:
        streams = [Stream(target.address, prompts[k % 2]) for k in range(4)]
        assert all(s.started.wait(60) for s in streams), "the streams never produced tokens"  # batch 4: all run
        assert draft.terminate() == 0
        for s in streams:
            s.join(120)
        assert [s.error for s in streams] == [None] * 4
        assert [s.tokens for s in streams] == [refs[k % 2] for k in range(4)]
        with Client(target.address, timeout=60) as c:  # the worker serves on alone
            assert c.generate(prompt_token_ids=prompts[0], max_tokens=8).token_ids == refs[0][:8]
    finally:
        target.kill()
        draft.kill()
