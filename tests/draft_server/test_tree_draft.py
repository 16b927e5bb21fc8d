"""Beam-search candidate trees on the draft engine: the right shape and probabilities, batched with chains in
the same passes, the draft KV back at the verified prefix, and exact output when the target verifies them."""

import torch

from draft_server.engine import DraftEngine
from draft_server.tree_draft import BeamTree, fit_width, tree_nodes
from starjar.spec.policy import FixedGamma
from starjar.spec.proposer import DraftRequest
from starjar.spec.sampling import SamplingParams
from starjar.spec.token_tree import TokenTree
from target_worker.config import engine_config
from target_worker.engine import TargetEngine


class TreeAsker:
    """Asks an in-process draft engine for trees of a fixed width (the target engine asks for chains)."""

    def __init__(self, inner: DraftEngine, width: int):
        self.inner, self.width = inner, width

    def propose(self, requests):
        return self.inner.propose([DraftRequest(r.seq_id, r.start, r.tokens, r.gamma, self.width) for r in requests])

    def release(self, seq_ids):
        self.inner.release(seq_ids)


def test_beam_tree_shape_and_path_probabilities():
    b = BeamTree(depth=3, width=2)
    b.expand(torch.tensor([[0.0, 2.0, 1.0, -1.0]]))  # the root: children 1 then 2
    assert b.tokens == [1, 2] and b.parents == [-1, -1] and b.beams == [0, 1]
    assert b.layout() == (1, [-1, 0, 0])  # both beams join the region under the root
    b.expand(torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]]))
    t = b.tree()
    assert len(t) == tree_nodes(2, 2) == 6 and t.parents[2:] == (0, 0, 1, 1)
    p_root = torch.softmax(torch.tensor([0.0, 2.0, 1.0, -1.0]), -1)
    p_child = torch.softmax(torch.tensor([3.0, 0.0, 0.0, 0.0]), -1)
    assert abs(t.path_probs[2] - float(p_root[1] * p_child[0])) < 1e-6
    assert fit_width(4, 8, 64) == 4 and tree_nodes(4, 4) <= 64 < tree_nodes(4, 5)


def test_trees_and_chains_share_passes_and_match_a_fresh_draft(models, prompt_ids):
    draft = models["draft"]
    eng = DraftEngine(draft)
    reqs = [DraftRequest(("t", 0), 0, prompt_ids[0], 4, 3), DraftRequest(("t", 1), 0, prompt_ids[1], 4, 0)]
    tree, chain = eng.propose(reqs)
    assert isinstance(tree, TokenTree) and len(tree) == tree_nodes(4, 3) and tree.depth == 4
    assert eng.stats.passes <= 2 + 3  # prompts (catch-ups, by length) then three passes shared by both
    # The tree's first child is the draft's greedy token; a fresh chain agrees.
    fresh = DraftEngine(draft).propose([DraftRequest(("t", 0), 0, prompt_ids[0], 4)])[0]
    assert tree.tokens[0] == fresh[0] and chain == DraftEngine(draft).propose([reqs[1]])[0]
    # Each depth-2 node's probability is its parent's times the draft's conditional, recomputed without cache.
    ids = prompt_ids[0]
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        with torch.no_grad():
            lg = draft.model(input_ids=torch.tensor([ids + path[:-1]])).logits[0, -1]
        cond = float(torch.softmax(lg.float(), -1)[path[-1]])
        parent = tree.parents[node]
        expect = cond * (tree.path_probs[parent] if parent >= 0 else 1.0)
        assert abs(tree.path_probs[node] - expect) < 2e-3, (node, tree.path_probs[node], expect)
    # Only the verified prefix stays in the draft's KV.
    assert eng.cache.lengths[eng._seqs[("t", 0)].slot] == len(prompt_ids[0])


def test_target_with_draft_trees_equals_target_alone(models, prompt_ids, reference):
    proposer = TreeAsker(DraftEngine(models["draft"]), width=2)
    engine = TargetEngine(models["llama"], proposer, FixedGamma(10), engine_config(4, 10))
    reqs = engine.generate(prompt_ids[:8], SamplingParams(max_tokens=48))
    assert [r.output_ids for r in reqs] == [ref[:48] for ref in reference("llama")[:8]]
    assert proposer.inner.stats.tree_jobs > 0 and engine.stats.accepted_tokens > 0
