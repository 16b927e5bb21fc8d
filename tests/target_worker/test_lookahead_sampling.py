"""Sampling through a draft server that drafts ahead keeps the target's distribution.

Many unseeded requests for one prompt sampled through a real draft server with `--lookahead chain` or
`fanout` (the target's own weights as the draft, so staged rounds and branches are hit) against the target
decoding alone (seeded, which fixes its sample; seeded draws through the drafts would repeat it whatever was
drafted, so those are unseeded). Top-k 2 keeps each position's support small; the eighth token's marginal
(after a round that lookahead may have answered) must not tell the two apart (chi-square test of homogeneity);
a sample biased towards the likeliest token is caught by the same test.
"""

import time
from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from draft_server import fanout
from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer

N = 600
POSITION = 7  # the eighth output token: two rounds in at least, so a round lookahead answered may draw it


def _params(first_seed: int | None) -> list[SamplingParams]:
    """Seeded draws depend on their position alone (the same whatever was drafted); unseeded ones (None) come
    from the engine's own generator, so the path through the drafts decides which numbers each draw takes."""
    return [SamplingParams(max_tokens=POSITION + 1, temperature=1.0, top_k=2, ignore_eos=True,
                           seed=None if first_seed is None else first_seed + i) for i in range(N)]


def _pvalue(a: Counter, b: Counter) -> float:
    """Homogeneity of two samples' counts; tokens seen fewer than 10 times in all are pooled into one cell."""
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rows = [[a[t] for t in common] + [sum(a.values()) - sum(a[t] for t in common)],
            [b[t] for t in common] + [sum(b.values()) - sum(b[t] for t in common)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    assert len(rows[0]) >= 2  # a distribution to test
    return chi2_contingency(rows).pvalue


def _alone(models, prompt, params) -> Counter:
    eng = TargetEngine(models["llama"], None, FixedGamma(0), EngineConfig(max_batch_size=16))
    return Counter(r.output_ids[POSITION] for r in eng.generate([prompt] * N, params))


@pytest.mark.parametrize("lookahead", ["chain", "fanout"])
def test_the_eighth_tokens_distribution_through_lookahead_is_the_targets(models, prompt_ids, lookahead, monkeypatch):
    monkeypatch.setattr(fanout, "MIN_LIKELIHOOD", 0.0)  # fanout: a tiny random draft's flat probabilities branch
    prompt = prompt_ids[3]
    alone = _alone(models, prompt, _params(10_000))
    with BackgroundDraftServer(models["llama"], DraftServerConfig(lookahead=lookahead)) as srv:
        rp = RemoteProposer(srv.address, models["llama"].fingerprint, "chi", 2.0, backoff_s=(0.02, 0.2))
        eng = TargetEngine(models["llama"], rp, FixedGamma(3), EngineConfig(max_batch_size=16))
        eng.send_ahead = rp.send_ahead
        if lookahead == "fanout":  # a target as slow as a real one leaves the draft time for branches
            eng.step_listener = lambda batch, gamma: time.sleep(0.04)
        assert rp.wait_attached(10)
        through = Counter(r.output_ids[POSITION] for r in eng.generate([prompt] * N, _params(None)))
        rp.close()
        stats = srv.server.stats.snapshot()
    assert stats["lookahead_hits"] > 0 and eng.stats.accepted_tokens > 0  # the path under test ran
    assert (stats["lookahead_branch_hits"] > 0) == (lookahead == "fanout")
    assert _pvalue(alone, through) > 0.001, (alone, through)  # unseeded: a false alarm once in 1000 runs


def test_the_test_catches_a_sample_drawn_from_another_distribution(models, prompt_ids):
    # Control: the target alone at top-k 1 for a third of the requests (a sampler biased to the likeliest
    # token) is told apart from the unbiased sample.
    prompt = prompt_ids[3]
    alone = _alone(models, prompt, _params(10_000))
    params = _params(30_000)
    for i in range(0, N, 3):
        params[i] = SamplingParams(max_tokens=POSITION + 1, temperature=1.0, top_k=1, seed=30_000 + i,
                                   ignore_eos=True)
    assert _pvalue(alone, _alone(models, prompt, params)) < 0.001
