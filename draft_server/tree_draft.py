"""Beam-search candidate trees on the draft server (AdaServe section 4.2, the speculation phase).

Per sequence and round: width w, depth d. The round's first pass (its catch-up) scores the root, the
sequence's last verified token; every later pass feeds the w current beams of that sequence, as one row
beside the other sequences' chains and trees, under a tree mask. Each pass adds the top-w children of
every scored node to the candidate tree (with the draft's path probability, the product of its softmax
along the path) and keeps the w most probable of them as the next beams. After d passes the tree has
w + (d - 1) * w^2 nodes; w = 1 is the greedy chain of d tokens.

Only beams enter the draft's KV cache (they are what the next pass attends to); the tree's other nodes
are leaves whose scores came with their parent's logits. Once the tree is done the cache is rolled back to
the verified prefix: the target chooses what is true.
"""

from __future__ import annotations

import time

import torch

from starjar.spec.token_tree import MAX_TREE_NODES, TokenTree


def tree_nodes(depth: int, width: int) -> int:
    """Nodes of a full beam tree; the draft KV a round feeds beyond its catch-up is (depth - 1) * width."""
    return 0 if depth <= 0 else width + (depth - 1) * width * width


def fit_width(depth: int, width: int, max_nodes: int = MAX_TREE_NODES) -> int:
    """The widest width <= `width` whose tree stays within max_nodes."""
    while width > 1 and tree_nodes(depth, width) > max_nodes:
        width -= 1
    return max(1, width)


class BeamTree:
    """One sequence's candidate tree while it is built, pass by pass."""

    def __init__(self, depth: int, width: int):
        self.depth, self.width = depth, width
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self.level = 0  # depths expanded so far
        self.beams: list[int] = []  # nodes to feed next pass
        # The cache region from the root on: region 0 is the root, then the beams in the order fed.
        self.region_parents: list[int] = [-1]
        self._region_of: dict[int, int] = {-1: 0}
        self.expand_s = 0.0  # time spent choosing children and beams (the tree's bookkeeping)

    @property
    def done(self) -> bool:
        return self.level >= self.depth

    def feed(self) -> list[int]:
        return [self.tokens[b] for b in self.beams]

    def layout(self) -> tuple[int, list[int]]:
        """(cached, parents) of this pass's row for RaggedKVCache.begin: the beams join the region."""
        cached = len(self.region_parents)
        for b in self.beams:
            self._region_of[b] = len(self.region_parents)
            self.region_parents.append(self._region_of[self.parents[b]])
        return cached, list(self.region_parents)

    def expand(self, logits: torch.Tensor) -> None:
        """logits [k, V]: the root's (first pass, k = 1) or each beam's, in feed order."""
        t0 = time.perf_counter()
        scored = self.beams if self.level else [-1]
        assert logits.shape[0] == len(scored), (logits.shape, len(scored))
        k = min(self.width, logits.shape[-1])
        top = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        probs, ids = top.values.tolist(), top.indices.tolist()
        added = []
        for parent, p_row, id_row in zip(scored, probs, ids, strict=True):
            base = self.probs[parent] if parent >= 0 else 1.0
            for p, tok in zip(p_row, id_row, strict=True):
                self.tokens.append(int(tok))
                self.parents.append(parent)
                self.probs.append(min(1.0, base * p))
                added.append(len(self.tokens) - 1)
        self.level += 1
        self.beams = sorted(added, key=lambda n: -self.probs[n])[: self.width]
        self.beams.sort()  # fed in node order, which keeps parents before children in the region
        self.expand_s += time.perf_counter() - t0

    def tree(self) -> TokenTree:
        return TokenTree(self.tokens, self.parents, self.probs)
