"""Where a tree's tokens sit in a verification pass: their RoPE positions and which earlier tokens they see.

A pass feeds one row per sequence: its pending token (the root) then the tree's nodes in topological
order. Every fed token is written to the cache at the next free position (root at L, node i at L + 1 + i),
but it is *positioned* at L + its depth and attends only to the verified prefix and its own ancestors,
so each node's logits are those the target would give the sequence ending in that node's path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def feed_parents(tree_parents: Sequence[int]) -> list[int]:
    """A tree's parents (-1 = root) as parents within the fed row (root = 0, node i = i + 1)."""
    return [-1] + [p + 1 for p in tree_parents]


def tree_layout(parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """parents: per fed token, the index of its parent within the row (-1 for the first, the root).

    Returns (depth [n] long: the position offset of each token, sees [n, n] bool: token i may attend to j)."""
    n = len(parents)
    depth = torch.zeros(n, dtype=torch.long)
    sees = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        assert -1 <= p < i, (i, p)
        if p >= 0:
            depth[i] = depth[p] + 1
            sees[i] = sees[p]
        sees[i, i] = True
    return depth, sees
