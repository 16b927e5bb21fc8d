"""Draining on SIGTERM, with real processes on loopback: generations in flight when the signal lands finish,
exactly as the target alone would have written them, and new ones are refused at once.
(`starjar down` on a Ray cluster: tests/system/test_ray_cluster.py.)"""

from __future__ import annotations

import signal
import time

from streams import Stream, refused_while_draining, wait_streaming

from benchmarks.launch import ServerProcess
from starjar import Client
from starjar.service.metrics import scrape

MAX_TOKENS = 300  # the long_prompts' references run this long without EOS
N_STREAMS = 8  # with --batch-size 2: two running, six queued; the queued ones are in flight too


def _gauges(metrics_address: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = scrape(metrics_address)
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


def test_sigterm_target_finishes_generations_in_flight_and_refuses_new_ones(model_dirs, long_prompts):
    prompts, refs = long_prompts
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    target = ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address, "--port", "0",
                           "--gamma", "3", "--batch-size", "2", "--worker-id", "drain", "--metrics-port", "0",
                           "--drain-timeout", "120")
    try:
        streams = [Stream(target.address, prompts[k % 2], MAX_TOKENS) for k in range(N_STREAMS)]
        _wait_accepted(target.ready["metrics"], N_STREAMS)
        wait_streaming(streams)
        t_signal = time.time()
        target.proc.send_signal(signal.SIGTERM)

        refused = refused_while_draining(target.address)
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
    target = ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address, "--port", "0",
                           "--gamma", "3", "--batch-size", "4", "--worker-id", "drain-d")
    try:
        streams = [Stream(target.address, prompts[k % 2], MAX_TOKENS) for k in range(4)]
        wait_streaming(streams, n=4)  # batch 4: all four run
        draft.proc.send_signal(signal.SIGTERM)
        assert not all(s.finish_reason for s in streams), "every stream was done before the signal"
        assert draft.proc.wait(timeout=60) == 0
        for s in streams:
            s.join(120)
        assert [s.error for s in streams] == [None] * 4
        assert [s.tokens for s in streams] == [refs[k % 2] for k in range(4)]
        with Client(target.address, timeout=60) as c:  # the worker serves on alone
            assert c.generate(prompt_token_ids=prompts[0], max_tokens=8).token_ids == refs[0][:8]
    finally:
        target.kill()
        draft.kill()
