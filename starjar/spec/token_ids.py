"""Token-id helpers: the one range rule (an id is valid in a vocabulary of V tokens when 0 <= id < V), and
the common prefix of two token lists (how far a cached sequence still matches the verified one).

Every component that takes ids from outside (a prompt, stop ids, a round's
verified tokens, a draft reply) checks them here, so the rule and its message
are written once.
"""

from __future__ import annotations

from collections.abc import Iterable

from starjar.errors import InvalidArgument

WIRE_LIMIT = 1 << 32  # token ids travel as uint32: no vocabulary can be larger


def first_out_of_range(ids: Iterable[int], vocab_size: int) -> int | None:
    """The first id of `ids` outside [0, vocab_size), or None when every id is valid."""
    return next((t for t in ids if not 0 <= t < vocab_size), None)


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    """InvalidArgument naming `field` (and the first bad id) when an id is outside [0, vocab_size)."""
    bad = first_out_of_range(ids, vocab_size)
    if bad is not None:
        raise InvalidArgument(field, f"ids must be in [0, {vocab_size})", bad)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
