"""A request's own cap on draft tokens per step (speculation.max_draft_tokens) in the engine: each sequence's
gamma, and its tree's nodes, are min(policy's, cap); cap 0 decodes it with the target alone while the rest of
the batch speculates; greedy output equals the target decoding alone whatever the caps."""

from dataclasses import dataclass, field

import pytest
from tree_proposers import TopKTreeProposer

from controller.colocated import colocated_engine
from starjar.errors import InvalidArgument
from starjar.spec.draft_cap import MAX_DRAFT_TOKENS
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.request import Request
from target_worker.tree_score import TreeConfig

GREEDY = SamplingParams(max_tokens=32)
CAPS = [None, 0, 1, 2]


@dataclass(eq=False)
class Watched(Request):
    """A request that keeps each decode step's draft count (what the target verified for it)."""

    rounds: list[int] = field(default_factory=list)

    def count_round(self, drafted: int, accepted: int) -> None:
        self.rounds.append(drafted)
        super().count_round(drafted, accepted)


def _run(engine, prompts, caps):
    asked = []  # (sequence, gamma) of every draft request the proposer got
    propose = engine.proposer.propose

    def recording(reqs):
        asked.extend((r.seq_id, r.gamma) for r in reqs)
        return propose(reqs)
    engine.proposer.propose = recording
    reqs = [engine.enqueue(Watched(list(p), GREEDY, max_draft_tokens=cap))
            for p, cap in zip(prompts, caps, strict=True)]
    while engine.has_work():
        engine.step()
    return reqs, asked


def test_chain_caps_in_one_batch(models, prompt_ids, reference):
    """The target as its own draft accepts every draft: a round's drafts are exactly its gamma."""
    engine = colocated_engine(models["llama"], models["llama"], 4, 8)
    caps = CAPS * 2
    reqs, asked = _run(engine, prompt_ids[:8], caps)
    assert [r.output_ids for r in reqs] == [ref[:32] for ref in reference("llama")[:8]]
    for r, cap in zip(reqs, caps, strict=True):
        limit = 4 if cap is None else cap
        assert r.rounds and max(r.rounds) == limit, (cap, r.rounds)
        assert r.drafted_tokens == sum(r.rounds) and r.accepted_tokens == r.drafted_tokens
        mine = [g for key, g in asked if key == r.draft_key]
        assert max(mine, default=0) == limit  # cap 0: the draft never hears of it
        if cap == 0:
            assert r.drafted_tokens == 0 and not mine


def test_tree_caps_depth_and_nodes(models, prompt_ids, reference):
    """AdaServe trees of up to 14 nodes from the target itself: a capped request verifies at most its cap."""
    proposer = TopKTreeProposer(models["llama"], widths=(2, 2, 2))
    cfg = EngineConfig(max_batch_size=4, max_gamma=12, tree=TreeConfig(width=2, budget=64, cap=16))
    engine = TargetEngine(models["llama"], proposer, FixedGamma(12), cfg)
    caps = [None, 0, 1, 3]
    reqs, _ = _run(engine, prompt_ids[:4], caps)
    assert [r.output_ids for r in reqs] == [ref[:32] for ref in reference("llama")[:4]]
    free, off, one, three = (max(r.rounds) for r in reqs)
    assert free > 3 and off == 0 and one == 1 and three == 3


@pytest.mark.parametrize("bad", [-1, MAX_DRAFT_TOKENS + 1, 1.5, "x", True])
def test_engine_refuses_a_bad_cap(models, prompt_ids, bad):
    engine = colocated_engine(models["llama"], models["draft"], 2, 2)
    with pytest.raises(InvalidArgument, match=f"0, {MAX_DRAFT_TOKENS}") as err:
        engine.add_request(prompt_ids[0], GREEDY, max_draft_tokens=bad)
    assert err.value.field == "speculation.max_draft_tokens"
    assert not engine.has_work()
