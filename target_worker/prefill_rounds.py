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
Where the cores are not shared, no step waits past the deadline. A prompt round unanswered for STALE_S
(and 3x its prediction) stops holding rounds back: a hung compute thread then shows as deadline misses and
the breaker again.

Decoding alone while the draft prefills pays only where the two do not share cores. Where they do (a local
cluster on one machine), both compute at once on oversubscribed OpenMP teams: on a 2-core Intel Xeon the
target's steps decoded alone then took 100-580 ms (by the OpenMP spin setting) against ~37 ms between
rounds (8 such steps cost 4.7 s of a 26.6 s run that took 20.6 s co-located). So the steps are timed, as
the time from one call to the next on the same sequences: between rounds with drafts, and decoded alone
while a prompt prefills (a gap after which a sequence joined is not a step: it held the target's own
prefill). When the last ALONE_SAMPLES alone steps (two at least) were all SHARED_SLOWDOWN times slower, the
cores are shared: a prompt round is then waited on, as a co-located draft's prefill would be, for up to
twice its predicted time past the deadline (at most MAX_WAIT_DEADLINES deadlines), and a step that finds
one unanswered waits for it the same way. Every PROBE_EVERY prompt rounds one is not waited on, so a draft
that moved off our cores is noticed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections import deque
from collections.abc import Hashable, Sequence

from starjar.spec.proposer import DraftRequest

MIN_PROMPT_TOKENS = 64  # shorter first rounds are ordinary rounds: their prefill fits the deadline
EMA = 0.3  # weight of the newest measurement of the draft's prefill seconds per prompt token, and of a step
STALE_S = 30.0  # a prompt round unanswered this long (and 3x its prediction) holds nothing back any more
# Steps decoded alone during a prefill this much slower than steps between rounds (which verify more tokens and
# are, uncontended, about 1.1x a step alone): the cores are shared, and waiting for the prefill is faster.
SHARED_SLOWDOWN = 1.5
SHARED_MIN_S = 0.01  # and at least this much slower (jitter on steps of a few ms is no evidence)
ALONE_SAMPLES = 3  # the alone steps the verdict looks at (the fastest of them decides)
MAX_WAIT_DEADLINES = 10  # a prompt round is never waited on for longer than this many deadlines
PROBE_EVERY = 8  # where the cores are shared, every 8th prompt round decodes alone beside it: a fresh sample


class PrefillRounds:
    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.s_per_token: float | None = None  # the draft server's compute per prompt token, as it reported
        # Unanswered rounds: prompt tokens, (sequence, tokens it will hold) per sequence, when sent.
        self._rounds: dict[int, tuple[int, list[tuple[Hashable, int]], float]] = {}
        # Per sequence, how many leading tokens the server is known to hold (an answered round carried them): a
        # sequence resent from 0 after a failed step is then no new prefill (the server reuses what it holds).
        self._held: dict[Hashable, int] = {}
        # Prompts sent ahead (target_worker.prompt_ahead) and not yet in a real round: tokens, when sent. The
        # server feeds them only while idle, so a first round may still find some of its prompt unfed.
        self._ahead: dict[Hashable, tuple[int, float]] = {}
        # The target's steps as seen from here (EMA seconds): between rounds with drafts, and decoded alone while
        # a prompt prefilled; the last call's end, its sequences and which kind of step followed it.
        self.step_s: float | None = None
        self.alone_steps: deque[float] = deque(maxlen=ALONE_SAMPLES)
        self._last_call: tuple[float, frozenset, str | None] | None = None
        self._prompt_rounds = 0  # waited-on candidates seen where the cores are shared (for the probes)
        self.shared_prior = False  # cores_shared before any step measured it (see forget)

    def prompt_tokens(self, sent: Sequence[DraftRequest]) -> int:
        """Tokens this round makes the draft prefill that it does not hold yet (0 for an ordinary round)."""
        n = sum(max(0, len(r.tokens) - self._held.get(r.seq_id, 0)) for r in sent if r.start == 0)
        n += sum(self._unfed_ahead(r.seq_id) for r in sent if r.start > 0 and r.seq_id in self._ahead)
        return n if n >= MIN_PROMPT_TOKENS else 0

    def sent_ahead(self, seq_id: Hashable, tokens: int) -> None:
        self._ahead[seq_id] = (tokens, time.monotonic())

    def _unfed_ahead(self, seq_id: Hashable) -> int:
        """A prompt sent ahead, now in its first real round: the tokens the server has likely not fed yet, as
        its prefill rate says (all of them while that is unknown)."""
        tokens, sent_s = self._ahead.pop(seq_id)
        if self.s_per_token is None:
            return tokens
        return max(0, tokens - int((time.monotonic() - sent_s) / self.s_per_token))

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

    def call_began(self, requests: Sequence[DraftRequest]) -> None:
        """A step asks for drafts: the time since the last call on the same sequences was the target's step,
        unless a sequence joined (the gap held the target's prefill of it)."""
        last, self._last_call = self._last_call, None
        if last is None:
            return
        ended, seqs, kind = last
        now_seqs = {r.seq_id for r in requests}
        if kind is None or not seqs & now_seqs or now_seqs - seqs:
            return  # another kind of step, idle time, or a prefill inside the gap
        gap = time.monotonic() - ended
        if kind == "alone":
            self.alone_steps.append(gap)
        else:
            self.step_s = gap if self.step_s is None else (1 - EMA) * self.step_s + EMA * gap

    def call_ended(self, requests: Sequence[DraftRequest], kind: str | None) -> None:
        """kind: "drafts" (a round answered with drafts), "alone" (decoding without waiting for a prompt's
        prefill), or None."""
        self._last_call = (time.monotonic(), frozenset(r.seq_id for r in requests), kind)

    @property
    def alone_step_s(self) -> float | None:
        """The fastest of the last alone steps (one inflated by something else decides nothing)."""
        return min(self.alone_steps) if len(self.alone_steps) >= 2 else None

    @property
    def cores_shared(self) -> bool:
        """Steps decoded alone during a prefill were far slower than usual: the draft computes on our cores. Until
        such steps were timed, the prior (a draft server on this host, too few CPUs for both: the first long
        prompt's alone steps cost 1.5 s on the 2-core Xeon before they told)."""
        alone = self.alone_step_s
        if self.step_s is None or alone is None:
            return self.shared_prior
        return alone > max(SHARED_SLOWDOWN * self.step_s, self.step_s + SHARED_MIN_S)

    def wait_s(self, tokens: int) -> float:
        """How long past the deadline a prompt round is waited on: twice its predicted time where the cores are
        shared (capped; every PROBE_EVERY-th is not waited on, to measure again), none elsewhere (the step
        decodes alone meanwhile)."""
        predicted = self.predicted_s(tokens)
        if predicted is None or not self.cores_shared:
            return 0.0
        self._prompt_rounds += 1
        if self._prompt_rounds % PROBE_EVERY == 0:
            return 0.0
        return min(2 * predicted, MAX_WAIT_DEADLINES * self.deadline_s)

    def in_flight_wait_s(self) -> float:
        """Where the cores are shared, how long a step waits for the unanswered prompt rounds rather than decode
        alone beside them: what is left of twice their predicted time (4 deadlines while no rate is known, but
        only where timings said so: on the prior alone, a server that never answered a prompt round may be hung,
        and nothing is waited on blind), capped as wait_s is."""
        if not self.cores_shared:
            return 0.0
        timed = self.step_s is not None and self.alone_step_s is not None
        now, left = time.monotonic(), 0.0
        for tokens, _, sent_s in list(self._rounds.values()):
            if tokens:
                predicted = self.predicted_s(tokens)
                budget = 2 * predicted if predicted is not None else 4 * self.deadline_s if timed else 0.0
                left = max(left, min(budget, MAX_WAIT_DEADLINES * self.deadline_s) - (now - sent_s))
        return left

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
            self._ahead.pop(seq_id, None)
        for round_id, (tokens, ends, sent_s) in list(self._rounds.items()):
            if any(s in gone for s, _ in ends):
                self._rounds[round_id] = (tokens, [(None if s in gone else s, e) for s, e in ends], sent_s)

    def forget(self, shared_prior: bool = False) -> None:
        """A new stream: the old one's rounds will never be answered, and the server holds no sequence. It may be
        another server, on other cores: whether they are shared is learnt again, from shared_prior
        (likely_shares_cores of its address)."""
        self.shared_prior = shared_prior
        self._rounds.clear()
        self._held.clear()
        self._ahead.clear()
        self.alone_steps.clear()
        self._last_call = None


def likely_shares_cores(address: str, threads: int) -> bool:
    """A draft server at `address` is on this host (loopback, or this host's name or address), and this process
    may use fewer CPUs than two processes of `threads` compute threads: it likely computes on our cores. The
    CPUs this process may use, not the host's: a container's processes share its CPU set. (A target pinned apart
    from its server is told by the probes.) The CPU check comes first: no name lookup where cores are spare."""
    if len(os.sched_getaffinity(0)) >= 2 * threads:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host in ("localhost", socket.gethostname())
    if not local:
        try:
            local = host in socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:
            local = False
    return local
