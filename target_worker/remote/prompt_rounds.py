"""The remote proposer's prompt rounds: a prompt sent before the target prefills it (to a server that prefills
ahead), or handed over after with the KV the target's prefill wrote (to a server whose draft is an int8 copy of
the target's weights: starjar.model.prompt_kv). Neither ever fails a step: a prompt not taken goes with its
sequence's first real round, for the server to prefill."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence

from starjar.model.prompt_kv import to_wire, weights_id, wire_bytes
from starjar.spec.proposer import DraftRequest
from target_worker.remote.round_codec import round_request, within_limits

MAX_OUTSTANDING = 2  # rounds a stream may have unanswered (the server reads no more than this either)
KV_MESSAGE_SLACK = 4096  # a prompt_kv round's bytes besides its KV (ids, tokens, framing), kept under the limit


class PromptRounds:
    """Mixed into target_worker.remote.client.RemoteProposer, whose stream, limits and reply queue it uses."""

    kv_weights = ""  # the target's weights id (starjar.model.prompt_kv): set, prompts go with their KV
    kv_token_bytes = 0  # one token's prompt_kv bytes for the target's shapes

    def send_ahead(self, requests: Sequence[DraftRequest]) -> list[bool]:
        """Prompts this worker is about to prefill, sent first to a server that feeds them in its idle time
        (Limits.prefills_ahead), so that the draft's prefill runs beside the target's: whether each went (its
        first real round then starts past it). Never waits, and nothing it does fails a step."""
        with self._lock:
            stream, limits = self._stream, self.limits
        went = [False] * len(requests)
        self._drop_late_replies()  # a request that ended at prefill leaves its send-ahead's answer to nobody
        if (stream is None or limits is None or not limits.prefills_ahead or not self.breaker.allow()
                or self._prefills.in_flight or len(self._outstanding) >= MAX_OUTSTANDING):
            return went
        sent, index = within_limits(requests, limits, Counter())  # one held back goes with its first round
        msg = round_request(next(self._round_ids), sent, self._wire_ids, self._next_wire_id.__next__)
        with self._lock:
            if not sent or self._stream is not stream:
                return went
            self._outstanding.add(msg.round_id)
        stream.send(msg)
        for r, i in zip(sent, index, strict=True):
            self._prefills.sent_ahead(r.seq_id, len(r.tokens))
            went[i] = True
        return went

    def hand_prompt_kv(self, target) -> None:
        """Hand each prompt this worker prefills to a server whose draft is an int8 copy of `target`'s weights
        with the KV the prefill wrote (seed(); Limits.prompt_kv_from), instead of the server prefilling it."""
        self.kv_weights, self.kv_token_bytes = weights_id(target.path), wire_bytes(target, 1)

    def seed(self, seq_id: Hashable, tokens: Sequence[int], layers: list) -> int:
        """A prompt just prefilled (target_worker.prompt_ahead's SeedDraft), with the target's per-layer (K, V):
        rounds of gamma 0 carrying its keys and values, each within the server's message limit and answered
        before the next goes. The prompt tokens the server took: all, or 0 (its first real round then sends
        the prompt for the server to prefill). Only to a server that advertised this target's weights."""
        with self._lock:
            stream, limits = self._stream, self.limits
        self._drop_late_replies()
        if (stream is None or limits is None or not self.kv_weights or limits.prompt_kv_from != self.kv_weights
                or not self.breaker.allow() or self._outstanding or self._prefills.in_flight or not tokens
                or (limits.max_tokens_per_sequence and len(tokens) > limits.max_tokens_per_sequence)):
            return 0
        room = min(limits.max_message_bytes or self._max_message_bytes, self._max_message_bytes) - KV_MESSAGE_SLACK
        per_round = max(1, room // self.kv_token_bytes)
        for at in range(0, len(tokens), per_round):
            end = min(len(tokens), at + per_round)
            part = DraftRequest(seq_id, at, list(tokens[at:end]), 0, 0, to_wire(layers, at, end))
            round_id = next(self._round_ids)
            msg = round_request(round_id, [part], self._wire_ids, self._next_wire_id.__next__)
            with self._lock:
                if self._stream is not stream:
                    return 0
                self._outstanding.add(round_id)
            stream.send(msg)
            resp = self._reply_by(round_id, time.perf_counter() + self.deadline_s)
            if resp is None or len(resp.sequences) != 1 or resp.sequences[0].resync:
                return 0  # the server dropped it (or will): sent again from 0 by the first round
        self.stats.seeded_tokens += len(tokens)
        return len(tokens)
