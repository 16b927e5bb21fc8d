"""Exact verification of a token tree with several deterministic candidates per node.

Vocabulary as in starjar.verify: the accepted tokens are a root-to-node path of the tree, followed by one
recovered token (sampled where every candidate child was rejected) or bonus token (after a leaf).

At a node with target distribution p and candidate children c_1..c_k tried in order: accept c_j with
probability p(c_j); on rejection set p(c_j) = 0 and renormalise, then try c_{j+1} against that residual; if
all are rejected, sample the recovered token from the last residual. This is speculative sampling with a
one-hot proposal applied k times in a row (SpecInfer's multi-candidate rule with deterministic drafts), so
each emitted token is distributed exactly as p, whatever the candidates: lossless at any temperature, top-p
and top-k. Greedy reduces to "follow the child whose token is the argmax, else emit the argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from starjar.sampling import SamplingParams, finite_logits, logits_to_probs
from starjar.token_tree import TokenTree
from starjar.verify import Verdict


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    path: tuple[int, ...] = ()  # the accepted nodes, root's child first (len == num_accepted)


def verify_tree(logits: torch.Tensor, tree: TokenTree, params: SamplingParams,
                gen: torch.Generator | None) -> TreeVerdict:
    """logits: [len(tree) + 1, V]; row 0 scores the token after the root (the last verified token), row i + 1
    the token after node i."""
    n = len(tree)
    assert logits.dim() == 2 and logits.shape[0] == n + 1, (logits.shape, n)
    children = tree.children()
    if params.greedy:
        best = finite_logits(logits).argmax(-1).tolist()  # [n + 1]
        return _greedy_walk(tree, children, best)
    probs = logits_to_probs(logits, params)  # [n + 1, V] float32
    path: list[int] = []
    row = 0  # the current node's logits row: 0 = root, i + 1 = node i
    while True:
        p = probs[row].double()  # a copy: rejections edit it
        taken = None
        for c in children[row]:
            tok = tree.tokens[c]
            pc = float(p[tok])
            if pc > 0.0 and float(torch.rand(1, generator=gen)) < pc:
                taken = c
                break
            if pc > 0.0:  # reject c: the residual is p without c (pc < 1 here, so mass remains)
                p[tok] = 0.0
                p = p / p.sum()
        if taken is None:
            nxt = int(torch.multinomial(p, 1, generator=gen))
            return _verdict(tree, path, nxt)
        path.append(taken)
        row = taken + 1


def _greedy_walk(tree: TokenTree, children: list[list[int]], best: list[int]) -> TreeVerdict:
    path: list[int] = []
    row = 0
    while True:
        match = next((c for c in children[row] if tree.tokens[c] == best[row]), None)
        if match is None:
            return _verdict(tree, path, best[row])
        path.append(match)
        row = match + 1


def _verdict(tree: TokenTree, path: list[int], nxt: int) -> TreeVerdict:
    return TreeVerdict(tokens=[tree.tokens[i] for i in path] + [nxt], num_accepted=len(path), path=tuple(path))
