"""Admission at N_max: concurrent attaches, refusals with reason=admission, refused targets still finish."""

from __future__ import annotations

import threading
import time

import pytest

from controller.fleet.admission import n_full, n_max, per_target_tokens_per_s
from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer


def test_n_max_follows_the_star_model():
    # S = 10 ms, Z = 35 ms: N_full = 5; tau = 2.5 tokens per cycle, alone 30 tokens/s.
    assert n_full(0.035, 0.010) == 5
    assert per_target_tokens_per_s(1, 0.035, 0.010, 2.5) == pytest.approx(2.5 / 0.045)
    assert n_max(0.035, 0.010, 2.5, 30.0) == 8  # 2.5 / (N * 0.01) > 30  <=>  N < 8.33
    assert n_max(0.035, 0.010, 1.2, 30.0) == 0  # 1.2 / 0.045 = 26.7 < 30: never worth it
    assert n_max(0.035, 0.010, 2.5, 30.0, cap=6) == 6


def _attach_concurrently(address, fingerprint, n):
    proposers = [None] * n

    def make(k):
        # A long backoff: a refused target does not come back during the check.
        proposers[k] = RemoteProposer(address, fingerprint, f"target-{k}", deadline_s=2.0, backoff_s=(30.0, 60.0))

    threads = [threading.Thread(target=make, args=(k,)) for k in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    deadline = time.time() + 10
    while time.time() < deadline:
        if sum(p.attached for p in proposers) + sum(p.stats.refusals["admission"] for p in proposers) == n:
            break
        time.sleep(0.05)
    return proposers


def test_eight_targets_at_n_max_four_twice(models, prompt_ids, reference):
    fp = models["llama"].fingerprint
    with BackgroundDraftServer(models["draft"], DraftServerConfig(max_targets=4)) as server:
        for round_ in range(2):
            # Counted per round: a refused target retries with backoff while round 0's engine runs (more
            # often on a slow machine), and those refusals are the server's too.
            before = server.server.service.refusals["admission"]
            proposers = _attach_concurrently(server.address, fp, 8)
            admitted = [p for p in proposers if p.attached]
            refused = [p for p in proposers if p.stats.refusals["admission"]]
            assert len(admitted) == 4 and len(refused) == 4, round_
            assert all(p.stats.refusals["admission"] == 1 and not p.attached for p in refused)
            assert server.server.service.refusals["admission"] - before == 4
            if round_ == 0:
                # A refused target's requests all complete, token for token the target's own.
                engine = TargetEngine(models["llama"], refused[0], FixedGamma(3), EngineConfig(max_batch_size=8))
                reqs = engine.generate(prompt_ids[:8], SamplingParams(max_tokens=24))
                assert [r.output_ids for r in reqs] == [r[:24] for r in reference("llama", 64)[:8]]
                assert engine.stats.drafted_tokens == 0 and refused[0].stats.fallbacks["detached"] > 0
            for p in proposers:
                p.close()
            deadline = time.time() + 5
            while len(server.server.sessions) and time.time() < deadline:
                time.sleep(0.05)
            assert len(server.server.sessions) == 0


def test_raising_n_max_admits_more_and_they_get_drafts(models, prompt_ids):
    fp = models["llama"].fingerprint
    cfg = DraftServerConfig(max_targets=1, max_sequences_per_target=2)
    with BackgroundDraftServer(models["draft"], cfg) as server:
        server.call(server.server.set_max_targets, 3)
        assert server.server.compute.engine.max_sequences == 6
        proposers = _attach_concurrently(server.address, fp, 3)
        assert all(p.attached for p in proposers)
        engines = [TargetEngine(models["llama"], p, FixedGamma(2), EngineConfig(max_batch_size=2)) for p in proposers]
        # 3 targets x 2 live sequences at once: more than the cap the server started with (1 x 2).
        params = SamplingParams(max_tokens=16)
        threads = [threading.Thread(target=e.generate, args=(prompt_ids[2 * k:2 * k + 2], params))
                   for k, e in enumerate(engines)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert all(e.stats.drafted_tokens > 0 for e in engines)
        assert sum(p.stats.fallbacks["resync"] for p in proposers) == 0
        for p in proposers:
            p.close()
