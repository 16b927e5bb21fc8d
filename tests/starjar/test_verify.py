"""Speculative verification is exact: greedy reduces to argmax, sampling keeps p."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from starjar.spec.sampling import BadLogits, PositionDraws, SamplingParams, finite_logits, logits_to_probs
from starjar.spec.verify import choose, verify

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


def _chi2_first_token(logits, draft, params, seed, sampler=verify, want=None):
    """N_SAMPLES independent rounds: one request's draws at N_SAMPLES positions far apart, tested against
    `want` (by default logits_to_probs's p)."""
    p = logits_to_probs(logits[0], params).double().numpy() if want is None else want
    draws = PositionDraws(seed)
    counts = np.zeros(len(p))
    for i in range(N_SAMPLES):
        counts[sampler(logits, draft, params, draws, 16 * i).tokens[0]] += 1
    # Pooling below would drop the bins p gives nothing: a token sampled outside p's support fails here.
    assert counts[p == 0].sum() == 0, f"{int(counts[p == 0].sum())} samples where p is 0"
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


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """p from its definition, in float64 and apart from logits_to_probs: top-k and top-p cut the logits' own
    ranking (ties kept by top-k), then softmax at the temperature, renormalised over what is left."""
    z = logits.double().numpy()
    z = z - z.max()
    if params.top_k and params.top_k < len(z):
        z = np.where(z < np.sort(z)[::-1][params.top_k - 1], -np.inf, z)
    p = np.exp(z / params.temperature)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= params.top_p]] = 0.0
        p /= p.sum()
    return p


@pytest.mark.parametrize("cut", [dict(top_k=5), dict(top_p=0.9)], ids=["top_k", "top_p"])
@pytest.mark.parametrize("end", ["coldest", "hottest"])
def test_the_extreme_temperatures_keep_the_target_distribution(models, end, cut):
    """At the smallest temperature that samples (GREEDY_BELOW) and the largest accepted (MAX_TEMPERATURE),
    with a top-k or a top-p cut, the first token is distributed as p computed in float64 from its definition.
    The hottest uses the model's logits as they are (p nearly uniform over what the cut keeps); the coldest
    scales them by GREEDY_BELOW first, or p would be the argmax alone and a chi-square would see nothing."""
    from starjar.spec.sampling import GREEDY_BELOW, MAX_TEMPERATURE

    logits, chain = _target_logits(models, gamma=3)
    temperature = GREEDY_BELOW if end == "coldest" else MAX_TEMPERATURE
    if end == "coldest":
        logits = logits * GREEDY_BELOW
    params = SamplingParams(temperature=temperature, **cut)
    want = _reference_probs(logits[0], params)
    assert np.allclose(logits_to_probs(logits[0], params).double().numpy(), want, atol=1e-5)
    kept = np.flatnonzero(want)
    assert 2 <= len(kept) < len(want)  # the cut cuts, and leaves a distribution to test
    draft = list(chain)
    draft[0] = int(kept[np.argsort(-want[kept])[1]])  # the runner-up: rejected often, the residual path runs
    assert _chi2_first_token(logits, draft, params, seed=20261123, want=want) > 0.01


def test_chi_square_has_power_against_a_biased_sampler(models):
    """Control: a sampler that always keeps the draft is caught by the same test."""
    logits, chain = _target_logits(models, gamma=3)
    params = SamplingParams(temperature=1.0)

    coin = torch.Generator().manual_seed(5)

    def biased(lg, draft, prm, draws, position):
        v = verify(lg, draft, prm, draws, position)
        return v if torch.rand(1, generator=coin) < 0.8 else type(v)(tokens=[draft[0]], num_accepted=1)

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
    a = [verify(logits, [1, 2, 3], params, d, pos).tokens for d in [params.make_draws()] for pos in range(20)]
    b = [verify(logits, [1, 2, 3], params, d, pos).tokens for d in [params.make_draws()] for pos in range(20)]
    assert a == b and len({tuple(t) for t in a}) > 1  # the same draws again, and not one draw everywhere


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=11),
                                    SamplingParams(temperature=1.2, top_k=5, seed=12),
                                    SamplingParams(temperature=1.0, top_p=0.8, seed=13)], ids=["t", "topk", "topp"])
def test_every_emitted_token_is_plain_decodings_whatever_the_draft(params):
    """Each token a verification emits is the one plain decoding with the same seed picks at its position, for
    any draft (likely, unlikely, none): a request's output cannot depend on what was drafted."""
    from starjar.spec.verify import sample_next

    g = torch.Generator().manual_seed(0)
    draws, rejected = params.make_draws(), 0
    for trial in range(300):
        logits = torch.randn(5, 40, generator=g) * 2
        base = 10 * trial
        plain = [sample_next(logits[i], params, draws, base + i) for i in range(5)]
        for draft in (plain[:4], [int(t) for t in torch.randint(40, (4,), generator=g)], plain[:2] + [39, 38], []):
            v = verify(logits[:len(draft) + 1], draft, params, draws, base)
            assert v.tokens == plain[:len(v.tokens)], (draft, v.tokens, plain)
            rejected += v.num_accepted < len(draft)
    assert rejected > 100  # the recovered-token path was exercised


def test_a_row_after_the_first_rejection_cannot_fail_the_round():
    """Rows past a rejected draft are never computed by the target alone: a non-finite one there is not looked at
    (it raised BadLogits for the whole step before). A +inf logit at a temperature below 1 is that token."""
    nan = float("nan")
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 1.0, 2.0], [nan, nan, nan]])
    assert verify(logits, [0, 1], SamplingParams(), None).tokens == [1]
    sampled = SamplingParams(temperature=0.5, top_k=1)
    assert verify(logits, [0, 1], sampled, PositionDraws(1), 0).tokens == [1]
    inf_row = torch.tensor([[float("inf"), 0.0, 1.0], [0.0, 1.0, 2.0]])
    p = logits_to_probs(inf_row[0], SamplingParams(temperature=0.5))
    assert not p.isnan().any() and p[0] == 1.0
    assert verify(inf_row, [2], SamplingParams(temperature=0.5), PositionDraws(3), 0).tokens == [0]


def test_greedy_choice_over_non_finite_logits_is_finite_logits_argmax():
    """A NaN never wins, +inf does, -inf never does; a row with nothing finite fails as BadLogits."""
    nan, inf = float("nan"), float("inf")
    greedy = SamplingParams()
    for row, want in (([0.0, nan, 1.0], 2), ([nan, 0.5, nan], 1), ([1.0, inf, 9.0], 1), ([-inf, 2.0, -inf], 1),
                      ([3.0, 1.0, 3.0], 0)):
        assert choose(torch.tensor(row), greedy, None, 0) == want == int(finite_logits(torch.tensor(row)).argmax())
    with pytest.raises(BadLogits):
        choose(torch.tensor([nan, -inf, nan]), greedy, None, 0)
