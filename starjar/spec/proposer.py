"""The proposer interface the target engine calls for drafts.

A target worker speaks to its proposer in deltas: per sequence, the verified
tokens it has not sent yet with the explicit position of the first one. The
proposer answers with up to gamma greedy draft tokens, or with None, meaning
"I lack this sequence's prefix: resend it from position 0" (resync). This is
the shape of the wire protocol, so the in-process draft engine and the
remote draft client are interchangeable.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from starjar.spec.token_tree import TokenTree


@dataclass(frozen=True)
class DraftRequest:
    seq_id: Hashable
    start: int  # position of tokens[0] within the sequence
    tokens: Sequence[int]  # verified tokens from `start` on (the whole prompt on first sight)
    gamma: int  # draft tokens wanted (a tree's depth); 0 = only record the tokens
    tree_width: int = 0  # > 1: a beam-search candidate tree of this width and depth gamma (0 or 1: a chain)
    # The target's keys and values for tokens (starjar.model.prompt_kv's wire form), taken instead of feeding
    # them: a prompt handed to a remote draft that is an int8 copy of the target (gamma 0)
    prompt_kv: bytes = b""


# Per request: the drafts (len <= gamma), a TokenTree when a tree was asked for, or None to ask for a resync
# from position 0.
DraftReply = list[int] | TokenTree | None


class Proposer(Protocol):
    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftReply]: ...

    def release(self, seq_ids: Sequence[Hashable]) -> None: ...
