"""Grouping ragged work into padded passes: shared by the target's prefill and the draft's catch-up."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def length_groups(items: list[T], length: Callable[[T], int], max_padding: float = 0.25,
                  short: int = 0) -> list[list[T]]:
    """Split items into passes of similar lengths.

    A padded pass costs about as much as if every row had the longest length, and a
    multi-token pass is compute-bound, so mixing a 2-token and a 200-token row wastes
    most of the pass. Sorted by length, a group closes once padding would exceed
    max_padding of its real tokens. Rows of at most `short` tokens always share a
    pass: so few positions per row leave a pass weight-bound, and padding them
    costs less than a second pass.
    """
    groups: list[list[T]] = []
    for item in sorted(items, key=length, reverse=True):
        if groups:
            g = groups[-1]
            real = sum(length(x) for x in g) + length(item)
            if length(g[0]) <= short or length(g[0]) * (len(g) + 1) <= (1 + max_padding) * real:
                g.append(item)
                continue
        groups.append([item])
    return groups
