"""Exact verification of a token tree with several deterministic candidates per node.

Vocabulary as in starjar.spec.verify: the accepted tokens are a root-to-node path of the tree, followed by one
recovered token (where no candidate child was the target's choice) or bonus token (after a leaf).

At each node the target's token is chosen as starjar.spec.verify chooses it (the argmax, or the request's draw
at that position), and the walk follows the child holding it, if any. With deterministic
candidates c_1..c_k this accepts some candidate with probability p(c_1) + ... + p(c_k) and otherwise emits a
token distributed as p without them, renormalised: SpecInfer's multi-candidate rule, so each emitted token is
distributed exactly as p whatever the candidates (lossless at any temperature, top-p and top-k), and it is the
token plain decoding with the same seed emits there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starjar.spec.sampling import PositionDraws, SamplingParams
from starjar.spec.token_tree import TokenTree
from starjar.spec.verify import Verdict, choose


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    path: tuple[int, ...] = ()  # the accepted nodes, root's child first (len == num_accepted)


def verify_tree(logits: torch.Tensor, tree: TokenTree, params: SamplingParams, draws: PositionDraws | None,
                position: int = 0) -> TreeVerdict:
    """logits: [len(tree) + 1, V]; row 0 scores the token after the root (the last verified token), row i + 1
    the token after node i; position: the sequence position of the token after the root. Only the rows on the
    walked path are looked at (at most depth + 1 of the tree's n + 1)."""
    n = len(tree)
    assert logits.dim() == 2 and logits.shape[0] == n + 1, (logits.shape, n)
    children = tree.children()
    path: list[int] = []
    row = 0  # the current node's logits row: 0 = root, i + 1 = node i
    while True:
        chosen = choose(logits[row], params, draws, position + len(path))
        match = next((c for c in children[row] if tree.tokens[c] == chosen), None)
        if match is None:
            return _verdict(tree, path, chosen)
        path.append(match)
        row = match + 1


def _verdict(tree: TokenTree, path: list[int], nxt: int) -> TreeVerdict:
    return TreeVerdict(tokens=[tree.tokens[i] for i in path] + [nxt], num_accepted=len(path), path=tuple(path))
