"""The engine with token trees: greedy output equals the target decoding alone (HF generate) on several
architectures, accepted paths through later siblings keep their KV, and sampling runs to completion."""

import pytest
from tree_proposers import TopKTreeProposer

from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from target_worker.config import engine_config
from target_worker.engine import TargetEngine

GREEDY = SamplingParams(max_tokens=48)
N = 8


def _engine(target, proposer, gamma=12, batch=4):
    return TargetEngine(target, proposer, FixedGamma(gamma), engine_config(batch, gamma))


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("gpt2", marks=pytest.mark.slow)])
def test_greedy_with_trees_equals_target_alone(models, prompt_ids, reference, family):
    proposer = TopKTreeProposer(models["draft"], widths=(2, 2, 1))
    engine = _engine(models[family], proposer)
    reqs = engine.generate(prompt_ids[:N], GREEDY)
    assert [r.output_ids for r in reqs] == [ref[:48] for ref in reference(family)[:N]]
    assert engine.stats.drafted_tokens > 0 and proposer.calls > 0
    assert engine.cache.tokens_used() == 0


def test_self_draft_tree_accepts_through_later_siblings(models, prompt_ids, reference):
    """The target as its own tree draft with its best token placed last among siblings: every accepted
    node is a later candidate written away from its final position, so a wrong KV move would change the
    output. Three levels accepted (and a bonus) per round."""
    proposer = TopKTreeProposer(models["llama"], widths=(2, 2, 2), argmax_last=True)
    engine = _engine(models["llama"], proposer, gamma=14)
    reqs = engine.generate(prompt_ids[:N], GREEDY)
    assert [r.output_ids for r in reqs] == [ref[:48] for ref in reference("llama")[:N]]
    assert engine.stats.acceptance_rate > 0.2  # 3 of 14 nodes per full round
    assert engine.stats.mean_accepted_len > 3.5


@pytest.mark.slow
def test_small_gamma_cuts_trees_and_chains_mix(models, prompt_ids, reference):
    """gamma 3 cuts each tree to its first 3 nodes (still a tree); mixed with gamma 0 rounds it stays exact."""
    proposer = TopKTreeProposer(models["draft"], widths=(2, 2, 1))
    engine = _engine(models["llama"], proposer, gamma=3, batch=3)
    reqs = engine.generate(prompt_ids[:N], GREEDY)
    assert [r.output_ids for r in reqs] == [ref[:48] for ref in reference("llama")[:N]]


@pytest.mark.slow
def test_sampling_with_trees_is_seeded_and_in_range(models, prompt_ids):
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11)
    runs = []
    for _ in range(2):
        engine = _engine(models["llama"], TopKTreeProposer(models["draft"], widths=(3, 1)))
        runs.append([r.output_ids for r in engine.generate(prompt_ids[:4], params)])
    assert runs[0] == runs[1]
    assert all(0 <= t < models["llama"].vocab_size for out in runs[0] for t in out)
    assert all(len(out) <= 32 for out in runs[0])
