"""Draft offload: the draft server after idle time, and a co-located draft lending its memory to the KV."""

from __future__ import annotations

import time

from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from draft_server.engine import DraftEngine
from starjar.spec.policy import FixedGamma, Overridable
from starjar.spec.proposer import DraftRequest
from starjar.spec.sampling import SamplingParams
from target_worker.elastic_kv import ElasticKV
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer


def test_offloaded_draft_answers_resync_at_once_and_reloads_in_the_background(models):
    eng = DraftEngine(models["draft"], auto_reload=False)
    assert eng.propose([DraftRequest("a", 0, [5, 6, 7], 2)])[0]
    eng.offload()
    assert eng.offloaded and eng.num_sequences == 0
    t0 = time.perf_counter()
    assert eng.propose([DraftRequest("a", 3, [8], 2)]) == [None]  # no drafts, no waiting
    assert time.perf_counter() - t0 < 0.05
    assert eng.start_reload() and eng.wait_reloaded(10)
    assert eng.propose([DraftRequest("a", 4, [9], 2)]) == [None]  # its KV was dropped: resync once
    assert eng.propose([DraftRequest("a", 0, [5, 6, 7, 8, 9], 2)])[0]


def test_draft_server_offloads_when_idle_and_outputs_stay_the_targets(models, prompt_ids, reference):
    cfg = DraftServerConfig(offload_after_s=0.3)
    with BackgroundDraftServer(models["draft"], cfg) as server:
        proposer = RemoteProposer(server.address, models["llama"].fingerprint, "t0", deadline_s=2.0)
        assert proposer.wait_attached(10)
        engine = TargetEngine(models["llama"], proposer, FixedGamma(3), EngineConfig(max_batch_size=4))
        ref = [r[:24] for r in reference("llama", 64)[:8]]
        first = engine.generate(prompt_ids[:4], SamplingParams(max_tokens=24))
        drafted = engine.stats.drafted_tokens
        assert drafted > 0
        deadline = time.time() + 5
        while not server.server.compute.engine.offloaded and time.time() < deadline:
            time.sleep(0.05)
        draft = server.server.compute.engine
        assert draft.offloaded and draft.offloads >= 1
        reloads = len(draft.reloads)
        second = engine.generate(prompt_ids[4:8], SamplingParams(max_tokens=24))
        assert [r.output_ids for r in first + second] == ref
        assert len(draft.reloads) > reloads and not draft.offloaded  # reloaded in the background, drafting again
        assert engine.stats.drafted_tokens > drafted
        text = server.server.metrics.registry
        from prometheus_client import generate_latest
        scrape = generate_latest(text).decode()
        assert f"starjar_draft_offloads_total {float(draft.offloads)}" in scrape
        assert f"starjar_draft_reload_seconds_count {float(len(draft.reloads))}" in scrape
        proposer.close()


def test_co_located_offload_lends_the_draft_memory_to_the_kv_cache(models, prompt_ids, reference):
    prompts = prompt_ids[:12]
    ref = [r[:24] for r in reference("llama", 64)[:12]]

    def run(elastic: bool):
        draft = DraftEngine(models["draft"], max_sequences=64)
        policy = Overridable(FixedGamma(3))
        policy.override = 0  # the controller turned speculation off under load
        kv = ElasticKV(draft, models["llama"], t_persist=2, tau_low_tokens=64) if elastic else None
        engine = TargetEngine(models["llama"], draft, policy, EngineConfig(max_batch_size=12, kv_budget_tokens=600),
                              elastic=kv)
        peak = 0

        def on_step(_):
            nonlocal peak
            peak = max(peak, engine.num_running)
            if kv is not None and kv.expansions and engine.num_waiting == 0:
                policy.override = None  # load fell: speculation may come back
        reqs = engine.generate(prompts, SamplingParams(max_tokens=24), on_step=on_step)
        return reqs, peak, kv, draft

    base, base_peak, _, _ = run(False)
    reqs, peak, kv, draft = run(True)
    assert [r.output_ids for r in base] == ref and [r.output_ids for r in reqs] == ref
    assert kv.expansions == 1 and kv.n_draft > 0
    assert peak > base_peak, (peak, base_peak)
    assert kv.contractions == 1 and draft.wait_reloaded(10)
