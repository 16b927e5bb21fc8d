"""Selection of tree nodes under a verification budget (AdaServe Algorithm 2 and the baselines), and the
engine and the real draft server with it: always a tree, within budget, and exact output."""

import pytest

from draft_server.background import BackgroundDraftServer
from draft_server.engine import DraftEngine
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from starjar.spec.token_tree import TokenTree
from starjar.spec.tree_select import POLICIES, Candidate, select, slo_need
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer
from target_worker.tree_score import TreeConfig

# Two candidate trees: root children a (0.6), b (0.3); a's children c (0.5), d (0.06)
T1 = TokenTree([1, 2, 3, 4], [-1, -1, 0, 0], [0.6, 0.3, 0.5, 0.06])
T2 = TokenTree([5, 6, 7], [-1, 0, 1], [0.2, 0.15, 0.1])


def _closed(t: TokenTree) -> bool:
    return all(p < i for i, p in enumerate(t.parents))


def test_global_greedy_takes_the_best_nodes_of_all_trees():
    out = select([Candidate(T1), Candidate(T2)], budget=2 + 3, policy="global_greedy")
    assert [list(t.tokens) for t in out] == [[1, 2, 3], []]


def test_adaserve_serves_the_sequence_behind_its_slo_first():
    # T2's sequence needs 1.3 expected tokens (1 + 0.2 + 0.15 >= 1.3): it gets two nodes before throughput.
    out = select([Candidate(T1), Candidate(T2, need=1.3)], budget=2 + 3, policy="adaserve")
    assert [list(t.tokens) for t in out] == [[1], [5, 6]]
    assert all(_closed(t) for t in out)


def test_adaserve_serves_an_slo_that_can_hold_before_one_that_cannot():
    # T1's sequence needs 10 tokens this step, more than its depth-2 tree can give (d + 1 = 3): T2's 1.3 goes first.
    out = select([Candidate(T1, need=10.0), Candidate(T2, need=1.3)], budget=2 + 2, policy="adaserve")
    assert [list(t.tokens) for t in out] == [[], [5, 6]]


def test_adaserve_slo_phase_gives_no_sequence_more_than_twice_its_share():
    # Four sequences that cannot hold their SLO, 4 nodes: n_max = 2 x (4 / 4), so two get 2 each, not one all 4.
    out = select([Candidate(T1, need=10.0)] * 4, budget=4 + 4, policy="adaserve")
    assert [len(t) for t in out] == [2, 2, 0, 0]


def test_equal_fixed_and_chain_shapes():
    out = select([Candidate(T1), Candidate(T2)], budget=2 + 4, policy="equal_greedy")
    assert [len(t) for t in out] == [2, 2]
    chain = select([Candidate(T1)], budget=10, policy="chain")[0]
    assert list(chain.tokens) == [1, 3] and chain.is_chain
    fixed = select([Candidate(T1)], budget=10, policy="fixed", widths=(2, 1))[0]
    assert list(fixed.tokens) == [1, 2, 3]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_stays_within_budget_and_cap(policy):
    cands = [Candidate(T1, need=3.0, cap=2), Candidate(T2, need=0.5)]
    out = select(cands, budget=5, policy=policy)
    assert all(_closed(t) for t in out) and len(out[0]) <= 2
    if policy not in ("fixed", "chain"):
        assert sum(len(t) for t in out) <= 5 - 2


def test_slo_need():
    assert slo_need(None, 1.0, 10, 0.1) is None
    assert slo_need(0.05, 1.0, 10, 0.1) == pytest.approx(12.0)  # 1.1 s / 0.05 - 10


def _tree_engine(target, proposer, policy, budget=24):
    cfg = EngineConfig(max_batch_size=4, max_gamma=6, tree=TreeConfig(policy, width=3, budget=budget, cap=12))
    return TargetEngine(target, proposer, FixedGamma(4), cfg)


@pytest.mark.parametrize("policy", ["adaserve", pytest.param("equal_greedy", marks=pytest.mark.slow),
                                    pytest.param("fixed", marks=pytest.mark.slow)])
def test_engine_with_selected_trees_equals_target_alone(models, prompt_ids, reference, policy):
    engine = _tree_engine(models["llama"], DraftEngine(models["draft"]), policy)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=48)) for p in prompt_ids[:8]]
    for i, r in enumerate(reqs):
        r.tpot_slo_s = 0.001 if i % 2 else None  # unreachable for half: they take the SLO phase's nodes
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in reqs] == [ref[:48] for ref in reference("llama")[:8]]
    assert engine.proposer.stats.tree_jobs > 0 and engine.trees.select_s


def test_trees_through_the_real_draft_server(models, prompt_ids, reference):
    with BackgroundDraftServer(models["draft"]) as srv:
        rp = RemoteProposer(srv.address, models["llama"].fingerprint, "trees", 5.0, backoff_s=(0.02, 0.2))
        assert rp.wait_attached(10) and rp.limits.max_tree_width >= 3
        engine = _tree_engine(models["llama"], rp, "adaserve")
        reqs = engine.generate(prompt_ids[:6], SamplingParams(max_tokens=40))
        assert [r.output_ids for r in reqs] == [ref[:40] for ref in reference("llama")[:6]]
        snap = srv.server.stats.snapshot()
        assert snap["tree_rounds"] > 0 and snap["tree_nodes"] >= 3 * snap["tree_rounds"]
        assert engine.stats.accepted_tokens > 0 and not rp.stats.fallbacks
        rp.close()


def test_candidate_tree_shape_follows_the_batch():
    from target_worker.tree_score import TreeSelector

    sel = TreeSelector(TreeConfig("adaserve", width=4, budget=32, cap=16))
    assert sel.shape(1, 8) == (8, 4)  # gamma is D_max, the configured width W_max
    assert sel.shape(8, 8) == (4, 4) and sel.shape(16, 8) == (2, 2) and sel.shape(64, 8) == (1, 1)
    assert TreeSelector(TreeConfig("chain")).shape(1, 5) == (5, 0)  # chains: the draft's greedy chain
