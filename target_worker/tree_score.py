"""The score phase of a decode step where some sequences carry token trees.

One ragged pass feeds every round's pending token and its drafts: a chain as before, a tree as its nodes in
topological order under a tree mask (starjar.tree_attention). Each round gets its verdict; a tree round's
accepted path, written at scattered cache positions, is moved to the positions right after its pending
token, and everything past it is rolled back.
"""

from __future__ import annotations

from collections.abc import Sequence

from starjar.kv_cache import RaggedKVCache
from starjar.models import LoadedModel
from starjar.token_ids import first_out_of_range
from starjar.token_tree import TokenTree
from starjar.tree_attention import feed_parents
from starjar.tree_verify import verify_tree
from starjar.verify import verify


def score_rounds(model: LoadedModel, cache: RaggedKVCache, rounds: Sequence) -> None:
    """rounds: the engine's SeqRounds (req, draft, tree); sets each round's verdict and rolls its KV back."""
    ordered = sorted(rounds, key=lambda r: r.req.slot)
    feeds = [[r.req.output_ids[-1]] + (list(r.tree.tokens) if r.tree is not None else r.draft) for r in ordered]
    trees = [(0, feed_parents(r.tree.parents)) if r.tree is not None else None for r in ordered]
    logits = model.forward(cache, [r.req.slot for r in ordered], feeds, [list(range(len(f))) for f in feeds],
                           trees)
    for r, lg in zip(ordered, logits, strict=True):
        base = r.req.num_tokens - 1  # the pending token's cache position
        if r.tree is None:
            r.verdict = verify(lg, r.draft, r.req.params, r.req.generator)
        else:
            r.verdict = verify_tree(lg, r.tree, r.req.params, r.req.generator)
            keep_path(cache, r.req.slot, base, r.verdict.path)
        cache.truncate(r.req.slot, base + 1 + r.verdict.num_accepted)


def keep_path(cache: RaggedKVCache, slot: int, base: int, path: Sequence[int]) -> None:
    """Node i was written at base + 1 + i; the k-th accepted node belongs at base + 1 + k. Sources are never
    below their destinations and the copy reads before it writes, so the order is safe."""
    cache.move(slot, [base + 1 + i for i in path], [base + 1 + k for k in range(len(path))])


def as_tree(reply, vocab: int, max_nodes: int) -> TokenTree | list[int] | None:
    """A proposer's reply for one round: a chain (list), a tree cut to max_nodes, or None when unusable."""
    if isinstance(reply, TokenTree):
        tree = reply.prefix(max_nodes)
        if first_out_of_range(tree.tokens, vocab) is not None:
            return None
        return list(tree.tokens) if tree.is_chain else tree
    chain = [int(t) for t in reply[:max_nodes]]
    return chain if first_out_of_range(chain, vocab) is None else None
