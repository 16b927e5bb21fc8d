"""Tree verification is exact: greedy follows the target's argmax through the tree, sampling keeps p
(several candidates per node, the residual path included), and the engine's output with trees equals the
target decoding alone."""

import functools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from starjar.model.kv_cache import RaggedKVCache
from starjar.model.tree_attention import feed_parents, tree_layout
from starjar.spec.sampling import PositionDraws, SamplingParams, logits_to_probs
from starjar.spec.token_tree import TokenTree
from starjar.spec.tree_verify import verify_tree

N_SAMPLES = 20_000
V = 6


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny [8, 6] ops: on a busy 2-core machine a second intra-op thread makes each one wait
    milliseconds at a barrier (softmax 12 ms instead of 3 us)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _peaked(rows: list[int], v: int = 10) -> torch.Tensor:
    logits = torch.full((len(rows), v), -5.0)
    for r, tok in enumerate(rows):
        logits[r, tok] = 5.0
    return logits


def test_greedy_follows_the_argmax_child_wherever_it_is():
    #        root
    #      /  |   \
    #   0:4  1:3  2:7        (siblings tried in order)
    #        |  \
    #      3:1  4:2
    #            |
    #           5:9
    tree = TokenTree([4, 3, 7, 1, 2, 9], [-1, -1, -1, 1, 1, 4])
    # rows: root, then node 0..5; argmax after root = 3 (node 1), after node 1 = 2 (node 4), after 4 = 9, after 5 = 8
    logits = _peaked([3, 0, 2, 0, 0, 9, 8])
    v = verify_tree(logits, tree, SamplingParams(), None)
    assert (v.tokens, v.num_accepted, v.path) == ([3, 2, 9, 8], 3, (1, 4, 5))
    logits = _peaked([7, 0, 0, 5, 0, 0, 0])  # node 2 accepted, it has no children: bonus after it
    v = verify_tree(logits, tree, SamplingParams(), None)
    assert (v.tokens, v.path) == ([7, 5], (2,))
    v = verify_tree(_peaked([6, 0, 0, 0, 0, 0, 0]), tree, SamplingParams(), None)
    assert (v.tokens, v.num_accepted) == ([6], 0)  # no candidate matches: the target's token


def test_tree_shapes():
    t = TokenTree([5, 6, 7, 8], [-1, -1, 0, 2], [0.5, 0.3, 0.4, 0.2])
    assert t.depths() == [1, 1, 2, 3] and t.depth == 3 and not t.is_chain
    assert t.children() == [[0, 1], [2], [], [3], []]
    assert t.path_to(3) == [0, 2, 3] and len(t.prefix(2)) == 2
    assert TokenTree.chain([1, 2, 3]).is_chain
    depth, sees = tree_layout(feed_parents(t.parents))
    assert depth.tolist() == [0, 1, 1, 2, 3]
    assert sees[4].tolist() == [True, True, False, True, True]  # node 3 sees root, 0, 2 and itself
    for bad in ([-1, 1], [0], [-2]):
        with pytest.raises(Exception, match="parents"):
            TokenTree([1] * len(bad), bad)


@functools.cache
def _world(prefix: tuple[int, ...]) -> torch.Tensor:
    """A synthetic target: a fixed random next-token distribution for every prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(V, generator=g) * 1.5


TREE = TokenTree([0, 1, 2, 3, 4, 2, 5], [-1, -1, 0, 0, 1, 1, 2])


@functools.cache
def _tree_logits(prefix, tree):
    rows = [_world(prefix)] + [_world(prefix + tuple(tree.tokens[j] for j in tree.path_to(i)))
                               for i in range(len(tree))]
    return torch.stack(rows)


def _two_tokens(params, draws, tree, base):
    """Decode two tokens at positions base, base + 1 with tree rounds (a second round when the first emitted
    only one)."""
    out: tuple[int, ...] = ()
    while len(out) < 2:
        out += tuple(verify_tree(_tree_logits(out, tree), tree, params, draws, base + len(out)).tokens)
    return out[:2]


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = p * counts.sum()
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    pytest.param(SamplingParams(temperature=0.7, top_p=0.9), marks=pytest.mark.slow),
    pytest.param(SamplingParams(temperature=1.3, top_k=4), marks=pytest.mark.slow)], ids=["t1", "topp", "topk"])
def test_joint_of_two_tokens_matches_the_target(params):
    """Several candidates per node (the root has two, node 0 two), leaves with bonus tokens, and rejection
    of every candidate (the residual path): the first two tokens' joint law is the target's."""
    draws = PositionDraws(1234)
    counts = np.zeros(V * V)
    for i in range(N_SAMPLES):
        a, b = _two_tokens(params, draws, TREE, 16 * i)
        counts[a * V + b] += 1
    p1 = logits_to_probs(_world(()), params).double().numpy()
    joint = np.concatenate([p1[a] * logits_to_probs(_world((a,)), params).double().numpy() for a in range(V)])
    assert _chi2(counts, joint) > 0.01


def test_residual_path_with_three_rejectable_candidates():
    """Three candidates the target rarely picks at the root: most rounds reject all three and sample the
    renormalised residual; the first token is still distributed as p."""
    params = SamplingParams(temperature=1.0)
    p = logits_to_probs(_world(()), params).double().numpy()
    rare = [int(i) for i in np.argsort(p)[:3]]
    tree = TokenTree(rare, [-1, -1, -1])
    draws = PositionDraws(7)
    counts, rejected_all = np.zeros(V), 0
    for i in range(N_SAMPLES):
        v = verify_tree(_tree_logits((), tree), tree, params, draws, 16 * i)
        counts[v.tokens[0]] += 1
        rejected_all += v.num_accepted == 0
    assert rejected_all > N_SAMPLES // 2
    assert _chi2(counts, p) > 0.01


def test_chi_square_catches_a_sampler_that_skips_renormalising():
    """Control: accepting later candidates against the raw p (no renormalisation after a rejection) is
    biased, and the same test sees it."""
    params = SamplingParams(temperature=1.0)
    p = logits_to_probs(_world(()), params).double().numpy()
    tree = TokenTree([int(np.argmax(p)), int(np.argsort(p)[-2])], [-1, -1])
    gen = torch.Generator().manual_seed(3)
    counts = np.zeros(V)
    for _ in range(N_SAMPLES):
        u1, u2 = float(torch.rand(1, generator=gen)), float(torch.rand(1, generator=gen))
        if u1 < p[tree.tokens[0]]:
            counts[tree.tokens[0]] += 1
        elif u2 < p[tree.tokens[1]]:  # wrong: should be p(c2) / (1 - p(c1))
            counts[tree.tokens[1]] += 1
        else:
            r = p.copy()
            r[list(tree.tokens)] = 0
            counts[int(torch.multinomial(torch.tensor(r / r.sum()), 1, generator=gen))] += 1
    assert _chi2(counts, p) < 0.01


def test_cache_move_keeps_a_path_contiguous():
    cache = RaggedKVCache()
    s = cache.allocate()
    cache.begin([s], [6])
    k = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    cache.update(k, k, 0)
    cache.move(s, [3, 5], [1, 2])
    cache.truncate(s, 3)
    assert cache._keys[0][s, 0, :3, 0].tolist() == [0.0, 3.0, 5.0]


def test_a_tree_emits_plain_decodings_tokens_whatever_its_candidates():
    """Each token a tree round emits is the one plain decoding with the same seed picks at its position."""
    from starjar.spec.verify import sample_next

    params = SamplingParams(temperature=1.0, seed=21)
    draws, g, walked = params.make_draws(), torch.Generator().manual_seed(2), 0
    for trial in range(200):
        tokens = [int(t) for t in torch.randint(V, (7,), generator=g)]
        tree = TokenTree(tokens, list(TREE.parents))
        logits = _tree_logits((trial,), tree)
        v = verify_tree(logits, tree, params, draws, 100 * trial)
        rows = [0] + [i + 1 for i in v.path]  # the rows the walk read, one per emitted token
        assert v.tokens == [sample_next(logits[r], params, draws, 100 * trial + d) for d, r in enumerate(rows)]
        walked += v.num_accepted
    assert walked > 0
