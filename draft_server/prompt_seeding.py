"""A draft engine's prompts taken with their KV computed instead of prefilled: in process from a co-located
target's cache, or from a target's SequenceRound.prompt_kv (starjar.model.prompt_kv)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from draft_server.draft_job import DraftSeq
from starjar.model.prompt_kv import from_wire
from starjar.spec.proposer import DraftRequest


class PromptSeeding:
    """Mixed into draft_server.engine.DraftEngine, whose sequences, cache and budgets it uses."""

    def seed(self, seq_id: Hashable, tokens: Sequence[int], layers: list) -> bool:
        """Take a new sequence's prompt with its KV computed (starjar.model.prompt_kv: the target's, per layer (K,
        V) [heads, len(tokens), dim]) instead of prefilling it. Whether it did: not for a sequence it holds, past
        its limits or budgets, offloaded, or with a hidden-state tap (TIDE trains on the draft's own passes)."""
        n = len(tokens)
        if (seq_id in self._seqs or self._offloaded or self.model.hidden_tap is not None or n == 0
                or len(self._seqs) >= self.max_sequences or n >= self.model.max_context):
            return False
        if not self._admits(DraftRequest(seq_id, 0, tokens, 1), None, n, self.ahead.extent()):
            return False
        seq = DraftSeq(slot=-1, seq_id=seq_id)
        self.cache.allocate(seq)
        if not self.cache.load_prefix(seq.slot, layers):
            self.cache.free(seq.slot)
            return False
        self._seqs[seq_id] = seq
        self._took(seq, tokens)
        return True

    def take_kv(self, req: DraftRequest) -> bool:
        """A round part carrying the target's KV for its tokens (SequenceRound.prompt_kv): the first part
        seeds a new sequence, each next one extends it where the last ended. A part that does not fit (a
        wrong size, a gap, the budgets) drops the sequence: its next round resyncs and prefills."""
        layers = from_wire(req.prompt_kv, self.model, len(req.tokens))
        if req.start == 0:
            self.release([req.seq_id])  # a new prompt under an id in use replaces it
            return layers is not None and self.seed(req.seq_id, req.tokens, layers)
        seq = self._seqs.get(req.seq_id)
        n = req.start + len(req.tokens)
        ahead = req.seq_id in self.ahead.stages or req.seq_id in self.ahead.ingests  # a round came: not a prompt
        if (layers is None or seq is None or ahead or n >= self.model.max_context
                or not req.start == len(seq.verified) == len(seq.cached) == self.cache.lengths[seq.slot]
                or not self._admits(req, seq, n, self.ahead.extent()) or not self.cache.append_kv(seq.slot, layers)):
            self.release([req.seq_id])
            return False
        self._took(seq, req.tokens)
        return True

    def _took(self, seq: DraftSeq, tokens: Sequence[int]) -> None:
        """Tokens whose KV the cache now holds past the sequence's end: verified, cached and counted."""
        seq.verified.extend(int(t) for t in tokens)
        seq.cached.extend(int(t) for t in tokens)
        self._count(seq.seq_id, len(tokens))
        self._longest = max(self._longest, len(seq.verified))
        self.stats.seeded_tokens += len(tokens)
