"""One round of the remote proposer, as it goes on the wire and comes back: the server's advertised limits
applied before sending, and each sequence's drafts read from the answer. Plain functions, no I/O."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from starjar.errors import StarjarError
from starjar.spec.proposer import DraftReply, DraftRequest
from starjar.spec.token_tree import TokenTree
from starjar.v1 import draft_pb2 as pb


def within_limits(requests: Sequence[DraftRequest], limits, fallbacks: Counter) -> tuple[list[DraftRequest], list[int]]:
    """The server's advertised limits, applied here (a round past them would be answered resync): gamma
    clamped, sequences over the token limit or past the per-round count held back (counted in `fallbacks`).
    Returns the requests to send and, for each, its index in `requests`."""
    sent, index = [], []
    for i, r in enumerate(requests):
        if limits is not None:
            too_long = (limits.max_tokens_per_sequence
                        and r.start + len(r.tokens) > limits.max_tokens_per_sequence)
            if too_long or (limits.max_sequences and len(sent) >= limits.max_sequences):
                fallbacks["over_limit"] += 1
                continue
            if limits.max_gamma and r.gamma > limits.max_gamma:
                r = DraftRequest(r.seq_id, r.start, r.tokens, limits.max_gamma, r.tree_width)
            if r.tree_width > max(1, limits.max_tree_width):  # an older server: chains only
                r = DraftRequest(r.seq_id, r.start, r.tokens, r.gamma, limits.max_tree_width)
        sent.append(r)
        index.append(i)
    return sent, index


def round_request(round_id: int, sent: Sequence[DraftRequest], wire_ids: dict[Hashable, int],
                  new_id: Callable[[], int]) -> pb.SpeculateRequest:
    """The round as it goes on the wire: each sequence under its wire id (one seen first gets new_id())."""
    msg = pb.SpeculateRequest(round_id=round_id)
    for r in sent:
        if r.seq_id not in wire_ids:
            wire_ids[r.seq_id] = new_id()
        msg.sequences.add(seq_id=wire_ids[r.seq_id], start=r.start, tokens=r.tokens, gamma=r.gamma,
                          tree_width=r.tree_width, prompt_kv=r.prompt_kv)
    return msg


def replies_of(resp: pb.SpeculateResponse, sent: Sequence[DraftRequest], index: Sequence[int], n_requests: int,
               fallbacks: Counter) -> list[DraftReply]:
    """The engine's replies, one per request. A sequence held back by the limits gets None: the server never
    saw these tokens, so the engine must not count them as sent (it resends from position 0 when the sequence
    fits again); one answered resync gets None too (counted in `fallbacks`)."""
    out: list[DraftReply] = [None for _ in range(n_requests)]
    for s, r, i in zip(resp.sequences, sent, index, strict=True):
        if s.resync:
            fallbacks["resync"] += 1
        else:
            out[i] = reply_of(s, r.gamma)
    return out


def reply_of(seq_draft: pb.SequenceDraft, gamma: int) -> DraftReply:
    """One sequence's drafts from the wire: a chain (at most gamma tokens) or, with parents, a token tree
    (one the target cannot read, malformed, is no drafts this step)."""
    if not seq_draft.parents:
        return list(seq_draft.tokens)[:gamma]
    try:
        return TokenTree(tuple(seq_draft.tokens), tuple(seq_draft.parents), tuple(seq_draft.path_probs))
    except StarjarError:
        return []
