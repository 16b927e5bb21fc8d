"""Which candidate-tree nodes one verification pass checks: AdaServe's selection and its baselines.

Plain Python (no torch): the target worker runs it every step. Inputs per sequence: its candidate tree (the
draft's path probabilities f(v) approximate the chance the target accepts the path to v, so the expected
accepted tokens of a tree is the sum of its f(v), AdaServe Theorem 3.1), how many accepted tokens its TPOT
SLO needs this step (A(r), None without an SLO) and a cap on its nodes. The budget B is tokens per pass,
the pending token of every sequence included.

Policies (one switch, `policy`):
  adaserve       Algorithm 2: sequences most behind their SLO first (those it can still hold this step
                 before those it cannot), each gets its best nodes until the expected accepted tokens
                 reach A(r) (capped at d + 1 and n_max nodes); then the rest of the budget goes to the
                 best nodes of all trees together (throughput-optimised);
  global_greedy  only the second phase: the best nodes of all trees (AdaServe 6.3);
  equal_greedy   the budget split equally, each tree its own best nodes (AdaServe 6.3);
  fixed          a fixed expansion per depth, SpecInfer-style: at depth k, the first widths[k-1] children;
  chain          the draft's greedy path only (the first child at every depth).
A node is only taken once its parent is, so every selection is a tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from starjar.spec.token_tree import TokenTree

POLICIES = ("adaserve", "global_greedy", "equal_greedy", "fixed", "chain")
# The user's switch (`--tree`): the policies above, where "chain" means today's chains (no trees at all), and
# "none", no speculation.
TREE_CHOICES = (*POLICIES, "none")


def trees_on(tree: str | None) -> bool:
    """Whether the --tree switch asks for token trees (not chains, no speculation or no switch)."""
    return tree not in (None, "chain", "none")

TREE_MAX_DEPTH = 8  # D_max when trees are on and no gamma is given: the budget sets the depth below it
SPECINFER_WIDTHS = (1, 1, 3, 1, 1, 1, 1, 1)  # AdaServe 6.1's SpecInfer baseline expansion
SLO_SHARE = 2  # n_max: the SLO phase gives one sequence at most this many times its equal share of the budget


@dataclass(frozen=True)
class Candidate:
    tree: TokenTree
    need: float | None = None  # A(r): accepted tokens the SLO needs this step (None: no SLO)
    cap: int = 64  # most nodes this sequence may get


def slo_need(tpot_slo_s: float | None, elapsed_s: float, decoded: int, step_s: float) -> float | None:
    """A(r) = (l + t_spec) / t_TPOT - o: tokens this step must yield for the sequence to be on its SLO after
    it (l: decode time so far, o: tokens decoded so far)."""
    if not tpot_slo_s:
        return None
    return (elapsed_s + step_s) / tpot_slo_s - decoded


class _Frontier:
    """One tree's selectable nodes (children of selected ones), best path probability first."""

    def __init__(self, tree: TokenTree):
        self.tree, self.kids = tree, tree.children()
        self.heap: list[tuple[float, int]] = []
        self.chosen: list[int] = []
        self._open(-1)

    def _open(self, node: int) -> None:
        probs = self.tree.path_probs
        for c in self.kids[node + 1]:
            heapq.heappush(self.heap, (-(probs[c] if probs else 0.0), c))

    def best(self) -> float | None:
        return -self.heap[0][0] if self.heap else None

    def take(self) -> float:
        neg, node = heapq.heappop(self.heap)
        self.chosen.append(node)
        self._open(node)
        return -neg

    def result(self) -> TokenTree:
        keep = sorted(self.chosen)
        index = {n: i for i, n in enumerate(keep)}
        t = self.tree
        return TokenTree([t.tokens[n] for n in keep], [index[t.parents[n]] if t.parents[n] >= 0 else -1
                                                       for n in keep],
                         [t.path_probs[n] for n in keep] if t.path_probs else ())


def select(cands: Sequence[Candidate], budget: int, policy: str = "adaserve",
           widths: Sequence[int] = SPECINFER_WIDTHS) -> list[TokenTree]:
    """The tree each sequence verifies; at most `budget` tokens in all, each sequence's pending token
    included (so budget - len(cands) nodes)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    if policy in ("fixed", "chain"):
        shape = widths if policy == "fixed" else (1,) * 64
        return [_shaped(c.tree, shape, c.cap) for c in cands]
    left = budget - len(cands)
    fronts = [_Frontier(c.tree) for c in cands]
    if policy == "equal_greedy":
        share = max(0, left) // max(1, len(cands))
        for f, c in zip(fronts, cands, strict=True):
            while len(f.chosen) < min(share, c.cap) and f.best() is not None:
                f.take()
        return [f.result() for f in fronts]
    if policy == "adaserve":
        left = _slo_phase(fronts, cands, left)
    _throughput_phase(fronts, cands, left)
    return [f.result() for f in fronts]


def _slo_phase(fronts: list[_Frontier], cands: Sequence[Candidate], left: int) -> int:
    """Nodes until 1 + sum f(v) reaches A_cap(r) = min(A(r), d + 1), at most n_max per sequence (the paper's
    limit, here SLO_SHARE times the equal share of the budget). Order: sequences whose SLO can still hold this
    step (A(r) <= d + 1), most behind first, then the others, best effort. The paper takes all by A(r) alone;
    on a budget of a few nodes per sequence that hands it to the SLOs that cannot hold and starves the ones
    that can (bench adaserve, budget 32, batch 8: attainment 0.00 where every baseline had 0.40)."""
    n_max = max(1, -(-SLO_SHARE * max(0, left) // max(1, len(cands))))
    with_slo = [i for i, c in enumerate(cands) if c.need is not None]
    order = sorted(with_slo, key=lambda i: (cands[i].need > fronts[i].tree.depth + 1, -cands[i].need))
    for i in order:
        f, c = fronts[i], cands[i]
        target = min(c.need, f.tree.depth + 1)
        expected = 1.0  # the bonus or recovered token always comes
        while expected < target and len(f.chosen) < min(c.cap, n_max) and left > 0 and f.best() is not None:
            expected += f.take()
            left -= 1
    return left


def _throughput_phase(fronts: list[_Frontier], cands: Sequence[Candidate], left: int) -> None:
    """The rest of the budget: the best node across every tree, one at a time."""
    heap = [(-f.best(), i) for i, f in enumerate(fronts) if f.best() is not None and cands[i].cap > len(f.chosen)]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        f = fronts[i]
        f.take()
        left -= 1
        if f.best() is not None and len(f.chosen) < cands[i].cap:
            heapq.heappush(heap, (-f.best(), i))


def _shaped(tree: TokenTree, widths: Sequence[int], cap: int) -> TokenTree:
    """Nodes whose rank among their siblings is below widths[depth - 1], parents kept, at most cap."""
    kids = tree.children()
    keep: list[int] = []
    stack = [(-1, 0)]
    while stack:
        node, depth = stack.pop()
        if depth >= len(widths):
            continue
        for c in kids[node + 1][: widths[depth]]:
            keep.append(c)
            stack.append((c, depth + 1))
    f = _Frontier(tree)
    f.chosen = sorted(keep)[:cap]  # node order is topological: a prefix keeps parents
    return f.result()
