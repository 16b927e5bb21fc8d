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
    the token after node i. Only the rows on the walked path are turned into probabilities (a tree of n nodes
    is walked through at most depth + 1 of its n + 1 rows), and a rejection only adds the candidate's mass to
    what is removed: the residual is renormalised once, where the recovered token is sampled."""
    n = len(tree)
    assert logits.dim() == 2 and logits.shape[0] == n + 1, (logits.shape, n)
    children = tree.children()
    if params.greedy:
        return _greedy_walk(tree, children, logits)
    path: list[int] = []
    row = 0  # the current node's logits row: 0 = root, i + 1 = node i
    while True:
        p = logits_to_probs(logits[row: row + 1], params)[0].double()
        left = float(p.sum())  # the residual's mass: 1 less the candidates rejected so far
        taken, rejected = None, []
        for c in children[row]:
            tok = tree.tokens[c]
            pc = 0.0 if tok in rejected else float(p[tok])
            if pc <= 0.0:
                continue
            # p(c) in the residual renormalised: the same draw as zeroing each rejected one and dividing.
            if float(torch.rand(1, generator=gen)) * left < pc:
                taken = c
                break
            rejected.append(tok)  # pc < left here (a draw below 1 takes a sure token), so mass remains
            left -= pc
        if taken is None:
            if rejected:
                p[rejected] = 0.0
            nxt = int(torch.multinomial(p, 1, generator=gen))  # multinomial normalises the residual itself
            return _verdict(tree, path, nxt)
        path.append(taken)
        row = taken + 1


def _greedy_walk(tree: TokenTree, children: list[list[int]], logits: torch.Tensor) -> TreeVerdict:
    """The argmax of the rows on the path only (torch's argmax would pick a NaN, hence finite_logits)."""
    path: list[int] = []
    row = 0
    while True:
        best = int(finite_logits(logits[row]).argmax())
        match = next((c for c in children[row] if tree.tokens[c] == best), None)
        if match is None:
            return _verdict(tree, path, best)
        path.append(match)
        row = match + 1


def _verdict(tree: TokenTree, path: list[int], nxt: int) -> TreeVerdict:
    return TreeVerdict(tokens=[tree.tokens[i] for i in path] + [nxt], num_accepted=len(path), path=tuple(path))
