"""Rounds that make the draft server prefill a prompt, told apart from a slow or hung server.

A round that carries a sequence from position 0 (a new request, a resync) makes the draft prefill that
whole prompt before it drafts: over a second for a 700-token prompt on the default pair on a 2-core CPU,
against a 0.5 s round deadline. Treated like any round, such a prompt cost two deadline waits and a
backlog miss, which opened the breaker for a second or more (demo, AMD EPYC: 4 deadline misses, 78 steps
without drafts behind the open breaker). Here such a round:
  - is not waited on when the server's own timings predict it will miss the deadline (it is sent, so the
    draft starts its prefill, and the step decodes without drafts at once);
  - does not count as a miss for the breaker when it does miss: the server is busy, not failing;
  - holds the stream's later rounds back while it is unanswered (they would queue behind it), again
    without counting against the breaker, until its late answer is read.
No step waits past the deadline. A prompt round unanswered for STALE_S (and 3x its prediction) stops
holding rounds back: a hung compute thread then shows as deadline misses and the breaker again.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

from starjar.proposer import DraftRequest

MIN_PROMPT_TOKENS = 64  # shorter first rounds are ordinary rounds: their prefill fits the deadline
EMA = 0.3  # weight of the newest measurement of the draft's prefill seconds per prompt token
STALE_S = 30.0  # a prompt round unanswered this long (and 3x its prediction) holds nothing back any more


class PrefillRounds:
    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.s_per_token: float | None = None  # the draft server's compute per prompt token, as it reported
        # Unanswered rounds: prompt tokens, (sequence, tokens it will hold) per sequence, when sent.
        self._rounds: dict[int, tuple[int, list[tuple[Hashable, int]], float]] = {}
        # Per sequence, how many leading tokens the server is known to hold (an answered round carried them): a
        # sequence resent from 0 after a failed step is then no new prefill (the server reuses what it holds).
        self._held: dict[Hashable, int] = {}

    def prompt_tokens(self, sent: Sequence[DraftRequest]) -> int:
        """Tokens this round makes the draft prefill that it does not hold yet (0 for an ordinary round)."""
        n = sum(max(0, len(r.tokens) - self._held.get(r.seq_id, 0)) for r in sent if r.start == 0)
        return n if n >= MIN_PROMPT_TOKENS else 0

    @property
    def in_flight(self) -> bool:
        """A prompt round is unanswered. One lost without the stream breaking stops counting after a while."""
        now = time.monotonic()
        for round_id, (tokens, _, sent_s) in list(self._rounds.items()):  # list: forget() runs on another thread
            if tokens and now - sent_s < max(STALE_S, 3 * (self.predicted_s(tokens) or 0.0)):
                return True
            if tokens:
                self._rounds.pop(round_id, None)
        return False

    def predicted_s(self, tokens: int) -> float | None:
        return None if self.s_per_token is None or not tokens else self.s_per_token * tokens

    def wont_make_it(self, tokens: int) -> bool:
        """Whether the server's past prefills say this one will miss the deadline (then nobody waits for it)."""
        predicted = self.predicted_s(tokens)
        return predicted is not None and predicted > self.deadline_s

    def sent(self, round_id: int, sent: Sequence[DraftRequest]) -> int:
        """A round went out; returns the prompt tokens it makes the draft prefill (0: an ordinary round)."""
        tokens = self.prompt_tokens(sent)
        self._rounds[round_id] = (tokens, [(r.seq_id, r.start + len(r.tokens)) for r in sent], time.monotonic())
        return tokens

    def is_prefill(self, round_id: int) -> bool:
        return bool(self._rounds.get(round_id, (0,))[0])

    def answered(self, round_id: int, resp) -> None:
        """An answer (in time or late; a pb.SpeculateResponse): what the server now holds, and its prefill rate
        from the rounds that carried prompts."""
        tokens, ends, _ = self._rounds.pop(round_id, (0, [], 0.0))
        for (seq_id, end), seq in zip(ends, resp.sequences, strict=False):
            if seq_id is None:  # released meanwhile: its late answer must not hold it again
                continue
            if seq.resync:
                self._held.pop(seq_id, None)
            else:
                self._held[seq_id] = end
        compute_s = resp.timings.compute_s
        if tokens and compute_s > 0:
            rate = compute_s / tokens
            self.s_per_token = rate if self.s_per_token is None else (1 - EMA) * self.s_per_token + EMA * rate

    def release(self, seq_ids: Sequence[Hashable]) -> None:
        gone = set(seq_ids)
        for seq_id in gone:
            self._held.pop(seq_id, None)
        for round_id, (tokens, ends, sent_s) in list(self._rounds.items()):
            if any(s in gone for s, _ in ends):
                self._rounds[round_id] = (tokens, [(None if s in gone else s, e) for s, e in ends], sent_s)

    def forget(self) -> None:
        """A new stream: the old one's rounds will never be answered, and the server holds no sequence."""
        self._rounds.clear()
        self._held.clear()
