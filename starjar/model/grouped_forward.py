"""Ragged rows through a RaggedKVCache in as few padded passes as pay: shared by both engines.

Each engine feeds rows of different lengths through one cache: the target its
newcomers' prompts and every sequence's gamma + 1 verification tokens, the
draft its catch-ups and one-token steps. Two rules hold for both:
- rows of very different lengths go in separate passes (`length_groups`): a
  padded pass costs as if every row were the longest;
- within a pass the rows go in slot order, so that a run of consecutive slots
  lets the cache read a view of its buffers instead of gathering a copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from starjar.model.kv_cache import RaggedKVCache
from starjar.model.loading import LoadedModel

T = TypeVar("T")


@dataclass(frozen=True)
class Pass(Generic[T]):
    """One forward pass: its rows in slot order, what each fed, and the logits asked for."""

    rows: list[T]
    feeds: list[list[int]]
    logits: list[torch.Tensor]  # per row: [1, V] at its last fed token, or [len(feed), V] with all_logits
    seconds: float  # the forward's wall time


def forward_pass(model: LoadedModel, cache: RaggedKVCache, rows: Sequence[T], feed: Callable[[T], list[int]],
                 slot: Callable[[T], int], all_logits: bool = False, tree: Callable[[T], tuple | None] | None = None,
                 last: Callable[[T], int] | None = None) -> Pass[T]:
    """One pass over `rows`, each appending feed(row) to its slot. Slots are read now: a caller that frees
    slots between passes (compaction moves others) must call this after it has done so.
    tree: a row's token-tree layout (RaggedKVCache.begin), called once per row and pass; last: how many of a
    row's trailing fed tokens need logits (1 unless all_logits)."""
    ordered = sorted(rows, key=slot)
    feeds = [feed(r) for r in ordered]
    counts = [len(f) if all_logits else min(len(f), last(r)) if last else 1 for r, f in zip(ordered, feeds,
                                                                                          strict=True)]
    wanted = [list(range(len(f) - n, len(f))) for f, n in zip(feeds, counts, strict=True)]
    trees = [tree(r) for r in ordered] if tree else []
    extra = {"trees": trees} if any(t is not None for t in trees) else {}  # chain-only passes: as before
    t0 = time.perf_counter()
    logits = model.forward(cache, [slot(r) for r in ordered], feeds, wanted, **extra)
    return Pass(ordered, feeds, logits, time.perf_counter() - t0)


def grouped_forward(model: LoadedModel, cache: RaggedKVCache, rows: Sequence[T], feed: Callable[[T], list[int]],
                    slot: Callable[[T], int], short: int = 0, max_pass_tokens: int | None = None,
                    tree: Callable[[T], tuple | None] | None = None, last: Callable[[T], int] | None = None,
                    context: Callable[[T], int] | None = None, max_gather_cells: int | None = None
                    ) -> Iterator[Pass[T]]:
    """Passes over rows grouped by feed length (longest first), logits at each row's last fed token.

    short: rows of at most this many tokens always share a pass (see length_groups). max_pass_tokens: a
    pass feeds at most this many tokens in all. Each pass runs when the iterator reaches it, so the caller
    may act on one pass's results before the next reads its slots. tree, last: as forward_pass's.
    max_gather_cells: a pass over slots that are not consecutive copies rows x its longest context (cached +
    fed keys) of K and V in every layer: at most this many. context: a row's keys, if not the cache's count."""
    lengths = {id(r): len(feed(r)) for r in rows}
    groups = length_groups(list(rows), lambda r: lengths[id(r)], short=short)
    if max_pass_tokens is not None:
        groups = _split_by_tokens(groups, lambda r: lengths[id(r)], max_pass_tokens)
    if max_gather_cells is not None:
        keys = context or (lambda r: cache.lengths[slot(r)] + lengths[id(r)])
        groups = _split_by_gather(groups, slot, keys, max_gather_cells)
    for group in groups:
        yield forward_pass(model, cache, group, feed, slot, tree=tree, last=last)


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


def _split_by_tokens(groups: list[list[T]], length: Callable[[T], int], max_tokens: int) -> list[list[T]]:
    """Split groups, keeping their order, so that none feeds more than max_tokens (a lone row may), padding
    included: a pass's scratch (mask, attention scores) is rows x its longest feed x its context, whatever
    the rows' real lengths."""
    out = []
    for group in groups:
        part, longest = [], 0
        for row in group:
            wider = max(longest, length(row))
            if part and (len(part) + 1) * wider > max_tokens:
                out.append(part)
                part, wider = [], length(row)
            part.append(row)
            longest = wider
        out.append(part)
    return out


def _split_by_gather(groups: list[list[T]], slot: Callable[[T], int], context: Callable[[T], int],
                     max_cells: int) -> list[list[T]]:
    """Split groups so that no pass over scattered slots gathers more than max_cells (rows x longest context)
    of K and V per layer: RaggedKVCache reads consecutive slots as a view, others as a copy, and for many
    long rows that copy is a large share of the cache (measured: +36 MiB per layer on a 512 MiB draft cache
    for the one-token steps of 32 rows at 4k tokens)."""
    out = []
    for group in groups:
        part, longest, consecutive = [], 0, True
        for row in sorted(group, key=slot):
            wider = max(longest, context(row))
            still = consecutive and (not part or slot(row) == slot(part[-1]) + 1)
            if part and not still and (len(part) + 1) * wider > max_cells:
                out.append(part)
                part, wider, still = [], context(row), True
            part.append(row)
            longest, consecutive = wider, still
        out.append(part)
    return out
