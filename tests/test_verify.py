"""Speculative verification is exact: greedy reduces to argmax, sampling keeps p."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from starjar.sampling import SamplingParams, logits_to_probs
from starjar.verify import verify

N_SAMPLES = 20_000


def test_greedy_accepts_matching_prefix_then_target_token():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 4, 9, 1]):
        logits[row, tok] = 5.0
    p = SamplingParams(temperature=0.0)
    assert verify(logits, [3, 4, 9], p, None).tokens == [3, 4, 9, 1]  # all accepted + bonus
    v = verify(logits, [3, 7, 9], p, None)
    assert (v.tokens, v.num_accepted) == ([3, 4], 1)  # second draft rejected, target's token instead
    assert verify(logits[:1], [], p, None).tokens == [3]


def _target_logits(models, gamma):
    m = models["llama"]
    cache = m.new_cache()
    prompt = m.tokenizer("Write a short story about a lighthouse")["input_ids"]
    slot = cache.allocate()
    last = m.forward(cache, [slot], [prompt], [[len(prompt) - 1]])[0][0]
    chain = [int(last.argmax())]
    logits = m.forward(cache, [slot], [chain], [[0]])[0]  # grow a plausible greedy chain
    for _ in range(gamma - 2):
        chain.append(int(logits[-1].argmax()))
        logits = m.forward(cache, [slot], [chain[-1:]], [[0]])[0]
    # Score the prompt + chain from scratch: rows 0..gamma follow prompt, d1, ..., d_gamma.
    fresh = m.new_cache()
    s = fresh.allocate()
    ids = prompt + chain[:gamma]
    rows = list(range(len(prompt) - 1, len(ids)))
    return m.forward(fresh, [s], [ids], [rows])[0], chain[:gamma]


def _chi2_first_token(logits, draft, params, seed, sampler=verify):
    p = logits_to_probs(logits[0], params).double().numpy()
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(len(p))
    for _ in range(N_SAMPLES):
        counts[sampler(logits, draft, params, gen).tokens[0]] += 1
    expected = p * N_SAMPLES
    # Pool rare tokens so every bin expects >= 5 (the chi-square approximation needs it).
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()  # exact totals (float rounding), as chisquare requires
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("draft_kind", ["likely", "unlikely"])
def test_first_token_matches_target_softmax(models, temperature, top_p, draft_kind):
    logits, chain = _target_logits(models, gamma=3)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    draft = list(chain)
    if draft_kind == "unlikely":
        # A draft the target rarely picks exercises the residual (rejection) path.
        p0 = logits_to_probs(logits[0], params)
        draft[0] = int(torch.argsort(p0, descending=True)[5])
    pval = _chi2_first_token(logits, draft, params, seed=20261122)
    assert pval > 0.01, pval


def test_chi_square_has_power_against_a_biased_sampler(models):
    """Control: a sampler that always keeps the draft is caught by the same test."""
    logits, chain = _target_logits(models, gamma=3)
    params = SamplingParams(temperature=1.0)

    def biased(lg, draft, prm, gen):
        v = verify(lg, draft, prm, gen)
        return v if torch.rand(1, generator=gen) < 0.8 else type(v)(tokens=[draft[0]], num_accepted=1)

    assert _chi2_first_token(logits, chain, params, seed=99, sampler=biased) < 0.01


def test_top_k_and_top_p_cut_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0  # the top token alone holds 64% >= 0.5


def test_seeded_requests_repeat():
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=0.9, seed=7)
    a = [verify(logits, [1, 2, 3], params, g).tokens for g in [params.make_generator()] for _ in range(20)]
    b = [verify(logits, [1, 2, 3], params, g).tokens for g in [params.make_generator()] for _ in range(20)]
    assert a == b
