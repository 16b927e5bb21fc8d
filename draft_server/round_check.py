"""What one Speculate round may ask for: pure checks that touch no session and no counter.

A round past the per-round limits (too many sequences, a seq_id twice) is an
InvalidArgument, which ends the stream. A single sequence past a limit (gamma,
its length, a token id outside the vocabulary, one live sequence too many) is
only answered resync: the stream and the round's other sequences go on.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from draft_server.config import DraftServerConfig
from starjar.errors import InvalidArgument
from starjar.spec.token_ids import first_out_of_range
from starjar.v1 import draft_pb2 as pb


def check_round(sequences: Sequence[pb.SequenceRound], cfg: DraftServerConfig, vocab_size: int,
                live: Collection[int], kv_token_bytes: int = 0) -> list[str | None]:
    """Per sequence, why it cannot be drafted (answered resync), or None. live: the session's live seq ids
    before this round (read, never changed); a new sequence is taken while fewer than the limit are live.
    kv_token_bytes: one token's SequenceRound.prompt_kv bytes on this server (0: it takes none)."""
    limit = cfg.max_sequences_per_target
    if len(sequences) > limit:
        raise InvalidArgument("sequences", f"at most {limit} per round", len(sequences))
    seen: set[int] = set()
    for i, s in enumerate(sequences):
        if s.seq_id in seen:
            raise InvalidArgument(f"sequences[{i}].seq_id", "must be unique in a round", s.seq_id)
        seen.add(s.seq_id)
    problems: list[str | None] = []
    n_live = len(live)
    for s in sequences:
        problem = sequence_problem(s, cfg, vocab_size) or prompt_kv_problem(s, kv_token_bytes)
        if problem is None and s.seq_id not in live:
            if n_live >= limit:
                problem = f"more than {limit} live sequences"
            else:
                n_live += 1
        problems.append(problem)
    return problems


def sequence_problem(s: pb.SequenceRound, cfg: DraftServerConfig, vocab_size: int) -> str | None:
    """Why one sequence is past the server's limits on its own, or None."""
    if s.gamma > cfg.max_gamma:
        return f"gamma {s.gamma} > {cfg.max_gamma}"
    if s.tree_width > cfg.max_tree_width:
        return f"tree_width {s.tree_width} > {cfg.max_tree_width}"
    if s.start + len(s.tokens) > cfg.max_tokens_per_sequence:
        return f"start + len(tokens) {s.start + len(s.tokens)} > {cfg.max_tokens_per_sequence}"
    bad = first_out_of_range(s.tokens, vocab_size)
    if bad is not None:
        return f"token id {bad} outside the vocabulary [0, {vocab_size})"
    return None


def prompt_kv_problem(s: pb.SequenceRound, kv_token_bytes: int) -> str | None:
    """Why a sequence's prompt_kv cannot be taken (its values are checked when the draft reads them), or None."""
    if not s.prompt_kv:
        return None
    if not kv_token_bytes:
        return "prompt_kv: this server prefills prompts itself (Limits.prompt_kv_from is empty)"
    if s.gamma or s.tree_width > 1:
        return f"prompt_kv with gamma {s.gamma}, tree_width {s.tree_width}: a round with it drafts nothing"
    want = kv_token_bytes * len(s.tokens)
    if len(s.prompt_kv) != want:
        return f"prompt_kv of {len(s.prompt_kv)} bytes, expected {want} ({len(s.tokens)} tokens x {kv_token_bytes})"
    return None
