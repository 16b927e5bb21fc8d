"""Online draft adaptation (TIDE) on the draft server: the buffer, the controller and the trainer together.

The compute loop calls three hooks, all on its own thread:
- `observe_round` after a round's reply is handed to its stream: the round's
  deltas update the acceptance averages and the buffer (a few dict lookups);
- `release` with the sequences the targets released: finished ones go to the
  buffer while collection is on;
- `idle_step` when the queue is empty and the loop would otherwise wait: one
  training micro-step. When a cycle ends, the adapted weights are swapped in
  (model.adapter, read once per pass) only if they beat the serving ones on
  held-out sequences. The loop runs idle steps only with no round in flight,
  so a swap always falls between two rounds; since the adapter only reads the
  draft's last hidden state, every sequence's KV stays valid across it.
Drafts are proposals: whatever the adapter does, verification keeps the output
the target's own.
"""

from __future__ import annotations

import logging
import time

from draft_server.tide.buffer import Finished, TrainingBuffer
from draft_server.tide.collect import CollectionControl
from draft_server.tide.config import TideConfig
from draft_server.tide.trainer import AdapterTrainer
from starjar.model.loading import LoadedModel

log = logging.getLogger(__name__)


class Tide:
    def __init__(self, model: LoadedModel, cfg: TideConfig | None = None):
        self.cfg = cfg = cfg or TideConfig()
        self.model = model
        self.buffer = TrainingBuffer(cfg.buffer)
        self.control = CollectionControl(cfg.collect)
        self.trainer = AdapterTrainer(model, cfg.train)
        self._seen = 0  # finished sequences handed to the trainer
        self.accepted = 0  # draft tokens accepted / proposed, all observed rounds (opted-out targets excluded)
        self.proposed = 0
        self.train_s = 0.0  # compute-loop seconds spent in idle steps
        self.swaps = 0
        self.cycles = 0
        self.heldout = 0.0  # held-out acceptance of the serving draft, as of the last cycle
        self._offered = None  # an adapter handed in from outside the compute thread, swapped in when idle
        model.hidden_tap = self.tap  # the serving passes' hidden states: the training signal, at no extra pass

    def close(self) -> None:
        """Stop tapping the draft's passes (the server stops; the model may be used again elsewhere)."""
        if self.model.hidden_tap == self.tap:
            self.model.hidden_tap = None
        self.started_s = time.perf_counter()

    # ---- hooks for the compute loop -----------------------------------------------------------

    def observe_round(self, requests, replies, train: bool = True) -> None:
        """requests: the round's DraftRequests; replies: per request, the drafts (None = resync).
        train: False for a target that attached with no_training (nothing of it is recorded)."""
        if not train:
            return
        for req, drafts in zip(requests, replies, strict=False):
            # A token tree's acceptance is not a chain's prefix: its round still records the verified tokens,
            # but no drafts to score (the acceptance control reads chains only).
            chain = drafts if isinstance(drafts, list) else None
            outcome = self.buffer.observe(req.seq_id, req.start, req.tokens, chain, self.control.collecting)
            if outcome is not None:
                self.accepted += outcome[0]
                self.proposed += outcome[1]
                self.control.observe(*outcome)

    def release(self, seq_ids) -> None:
        self.buffer.release(seq_ids)

    def tap(self, cache, slots: list[int], counts: list[int], hidden) -> None:
        """After each draft pass (the compute thread): keep the hidden states of tracked sequences while
        collecting. hidden [B, Q, H]; slot b fed counts[b] tokens, now the last of its cache."""
        if not self.control.collecting:
            return
        for b, (slot, n) in enumerate(zip(slots, counts, strict=True)):
            seq_id = getattr(cache.owner(slot), "seq_id", None)
            if seq_id is not None:
                self.buffer.keep_hidden(seq_id, cache.lengths[slot] - n, hidden[b, :n])

    def offer(self, adapter) -> None:
        """Swap this adapter in at the compute loop's next idle step (any thread; a trainer elsewhere, or a
        test). The loop must be woken to see it: a round, or a release, does."""
        self._offered = adapter

    def wants_idle(self) -> bool:
        """Whether an idle step has anything to do (else the loop just waits for rounds)."""
        if self._offered is not None or self.buffer.added > self._seen:
            return True
        return self.trainer.has_work()

    def idle_step(self) -> float:
        """One micro-step; returns its seconds."""
        t0 = time.perf_counter()
        offered, self._offered = self._offered, None
        if offered is not None:
            self.model.adapter = offered
            self.swaps += 1
        new, self._seen = self.buffer.take_new(self._seen)
        if new:
            self.trainer.add([Finished(s.tokens, s.prompt_len, dict(s.hidden)) for s in new])
            for s in new:  # the trainer owns their hidden states now (and bounds them)
                self.buffer.handed_over(s)
        result = self.trainer.step()
        if result is not None:
            self._end_cycle(*result)
        took = time.perf_counter() - t0
        self.train_s += took
        return took

    def _end_cycle(self, serving: float, candidate: float) -> None:
        self.cycles += 1
        deploy = self.control.training_result(serving, candidate)
        adapter = self.trainer.finish(deploy)
        if adapter is not None:
            self.model.adapter = adapter  # between rounds: the next pass proposes with it
            self.swaps += 1
        self.heldout = candidate if deploy else serving
        # Counts and rates only: never a token.
        log.info("draft adaptation cycle %d: held-out acceptance serving %.3f, adapted %.3f: %s", self.cycles,
                 serving, candidate, "swapped in" if deploy else "kept the serving draft, collection off")

    # ---- what GetStats and the metrics read -------------------------------------------------

    def snapshot(self) -> dict:
        c, t = self.control, self.trainer
        return {"acceptance_short": c.short or 0.0, "acceptance_long": c.long or 0.0,
                "collecting": c.collecting, "train_steps": t.steps, "swaps": self.swaps, "cycles": self.cycles,
                "train_s": self.train_s, "buffered_sequences": len(self.buffer.finished),
                "buffered_tokens": self.buffer.tokens,
                "heldout_acceptance": self.heldout,
                "acceptance_total": self.accepted / self.proposed if self.proposed else 0.0,
                "switched_on": c.switched_on, "switched_off": c.switched_off}
