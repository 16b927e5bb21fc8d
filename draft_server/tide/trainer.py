"""The trainer: a low-rank logit adapter for the draft, learned from buffered verified sequences.

What is trained is small and sits after the draft's last layer: logits +=
B (A h) + b, with h the draft's last hidden state (A: rank x hidden, B: vocab x
rank, b: a per-token bias). The draft's layers stay frozen, so
- the training data is the frozen draft's hidden state at each position of a
  buffered sequence and the token the target verified next. The serving
  passes computed those states already (draft_server.tide.adaptation taps them), so
  normally no pass of ours is needed; a sequence that arrives without them (a
  test, a cold buffer) is run through the draft in chunks;
- swapping an adapter in never invalidates any KV cache: a sequence in
  flight keeps its KV, and its next pass proposes with the new adapter.

All work is cut into micro-steps (chunk_tokens positions taken into the pools,
one gradient step over batch_positions positions, or eval_chunk held-out
positions scored: each at most one pass of the draft's head), so the
compute loop can run one whenever it would otherwise wait and a round that
arrives waits at most one micro-step. A cycle runs when enough new training
positions arrived: train a copy of the serving adapter, score it and the
serving one on held-out positions (exact next-token agreement with the target,
over the full vocabulary), and hand back the result; the caller decides
whether to deploy.
"""

from __future__ import annotations

import copy
import logging
from collections import deque

import torch
import torch.nn.functional as F

from draft_server.tide.buffer import Finished
from draft_server.tide.config import TrainConfig
from starjar.model.loading import LoadedModel

log = logging.getLogger(__name__)
MAX_QUEUED = 64  # finished sequences waiting for extraction


class LowRankLogits(torch.nn.Module):
    """delta logits [N, V] = (h A^T) B^T + b for hidden states h [N, H]. Starts as zero."""

    def __init__(self, hidden: int, vocab: int, rank: int, generator: torch.Generator | None = None):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(rank, hidden, generator=generator) / hidden ** 0.5)
        self.b = torch.nn.Parameter(torch.zeros(vocab, rank))
        self.bias = torch.nn.Parameter(torch.zeros(vocab))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.a.T) @ self.b.T + self.bias


class _Pool:
    """A ring of positions: the draft's last hidden state [H] and the token the target verified next."""

    def __init__(self, capacity: int):
        self.rows: deque[tuple[torch.Tensor, int]] = deque(maxlen=capacity)

    def add(self, h: torch.Tensor, labels: list[int]) -> None:
        for i, label in enumerate(labels):
            self.rows.append((h[i], label))

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.rows[i] for i in idx]
        return torch.stack([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


class AdapterTrainer:
    """Owned by the draft server's compute thread (the only thread that runs the draft)."""

    def __init__(self, model: LoadedModel, cfg: TrainConfig | None = None):
        self.model = model
        self.cfg = cfg = cfg or TrainConfig()
        self.hidden = int(model.model.config.hidden_size)
        self.vocab = int(model.head_logits(torch.zeros(1, self.hidden, dtype=model.dtype), adapted=False).shape[1])
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.train_pool = _Pool(cfg.max_positions)
        self.eval_pool = _Pool(cfg.max_eval_positions)
        self.new_positions = 0  # training positions added since the last cycle started
        self.sequences_seen = 0  # finished sequences extracted (every eval_every-th is held out)
        self._queue: deque[Finished] = deque()  # finished sequences waiting for extraction
        self._extracting: tuple[Finished, object, int, int, bool] | None = None  # seq, cache, slot, next pos, eval
        self.candidate: LowRankLogits | None = None  # being trained
        self._opt: torch.optim.Optimizer | None = None
        self._steps_left = 0
        self._eval_at = -1  # next held-out row to score; -1: not scoring
        self._eval_counts = [0, 0, 0]  # rows scored, serving correct, candidate correct
        self.steps = 0  # micro-steps run
        self.positions_captured = 0  # positions learned from the serving passes' hidden states
        self.positions_rerun = 0  # positions whose hidden state took a pass of ours (nothing was captured)
        self.cycles = 0
        self.last_eval: tuple[float, float] | None = None  # (serving, candidate) held-out acceptance

    # ---- what the caller sees -------------------------------------------------------------

    def add(self, sequences: list[Finished]) -> None:
        """Finished sequences to learn from (the newest MAX_QUEUED wait; older ones are dropped)."""
        self._queue.extend(sequences)
        while len(self._queue) > MAX_QUEUED:
            self._queue.popleft()

    def has_work(self) -> bool:
        return bool(self._queue or self._extracting or self.candidate is not None or self._cycle_due())

    def step(self) -> tuple[float, float] | None:
        """One micro-step. Returns (serving, candidate) held-out acceptance when a cycle just ended (the
        candidate is then in `self.candidate` until `finish` is called), else None."""
        self.steps += 1
        if self.candidate is None and self._cycle_due():
            self._start_cycle()
        if self.candidate is not None and self._steps_left > 0:
            self._train_step()
            return None
        if self.candidate is not None:
            return self._eval_step()
        self._extract_step()
        return None

    def finish(self, deploy: bool) -> LowRankLogits | None:
        """End the cycle: the trained adapter, frozen, when deployed (the caller swaps it in), else None."""
        cand, self.candidate, self._opt = self.candidate, None, None
        if not deploy or cand is None:
            return None
        frozen = copy.deepcopy(cand).eval()
        for p in frozen.parameters():
            p.requires_grad_(False)
        return frozen

    # ---- extraction: the frozen draft's hidden states of buffered sequences ------------------

    def _extract_step(self) -> None:
        if self._extracting is None:
            if not self._queue:
                return
            seq = self._queue.popleft()
            held_out = self.sequences_seen % self.cfg.eval_every == self.cfg.eval_every - 1
            self.sequences_seen += 1
            if seq.hidden:  # the serving passes' own hidden states: no pass of ours needed
                self._extracting = (seq, None, -1, 0, held_out)
            else:
                cache = self.model.new_cache()
                self._extracting = (seq, cache, cache.allocate(), 0, held_out)
        seq, cache, slot, pos, held_out = self._extracting
        if cache is None:
            self._take_captured(seq, pos, held_out)
            return
        end = min(len(seq.tokens) - 1, pos + self.cfg.chunk_tokens)  # the last token has no next one
        chunk = list(seq.tokens[pos:end])
        h = self.model.hidden_states(cache, [slot], [chunk])[0, : len(chunk)]  # [len(chunk), H]
        first = max(pos, seq.prompt_len - 1)  # positions whose next token the target generated
        if first < end:
            labels = list(seq.tokens[first + 1:end + 1])
            self._keep(h[first - pos:].float(), labels, held_out)
            self.positions_rerun += len(labels)
        self._extracting = None if end >= len(seq.tokens) - 1 else (seq, cache, slot, end, held_out)

    def _take_captured(self, seq: Finished, done: int, held_out: bool) -> None:
        """Up to chunk_tokens captured positions (in position order) into the pools."""
        positions = sorted(seq.hidden)[done:done + self.cfg.chunk_tokens]
        if positions:
            h = torch.stack([seq.hidden[p] for p in positions]).float()
            self._keep(h, [seq.tokens[p + 1] for p in positions], held_out)
            self.positions_captured += len(positions)
        done += len(positions)
        self._extracting = (seq, None, -1, done, held_out) if done < len(seq.hidden) else None

    def _keep(self, h: torch.Tensor, labels: list[int], held_out: bool) -> None:
        keep = [i for i, t in enumerate(labels) if t < self.vocab]  # the head cannot propose past its vocab
        if not keep:
            return
        pool = self.eval_pool if held_out else self.train_pool
        pool.add(h[keep].clone(), [labels[i] for i in keep])
        if not held_out:
            self.new_positions += len(keep)

    # ---- a cycle: train a copy, then score both on held-out positions -------------------------

    def _cycle_due(self) -> bool:
        return (self.new_positions >= self.cfg.min_new_positions and len(self.eval_pool) > 0
                and len(self.train_pool) >= self.cfg.batch_positions)

    def _start_cycle(self) -> None:
        serving = self.model.adapter
        if isinstance(serving, LowRankLogits) and serving.a.shape == (self.cfg.rank, self.hidden):
            cand = copy.deepcopy(serving)  # continue from what serves (TIDE fine-tunes the current draft)
            for p in cand.parameters():
                p.requires_grad_(True)
        else:
            cand = LowRankLogits(self.hidden, self.vocab, self.cfg.rank, self.gen)
        self.candidate = cand.train()
        self._opt = torch.optim.Adam(cand.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self._steps_left = self.cfg.steps_per_cycle
        self._eval_at, self._eval_counts = self._eval_first(), [0, 0, 0]
        self.new_positions = 0
        self.cycles += 1

    def _train_step(self) -> None:
        """One gradient step of next-token cross-entropy over the head's whole vocabulary: the logits the
        serving draft takes its argmax of (base + adapter on every id). A softmax over only the base's
        top-k and the truth (the first version) never saw the ids it raised at positions where they were
        not candidates, so it raised them everywhere: offline, one cycle on translation took held-out
        agreement 0.18 -> 0.0 for the target's first 12 layers and 0.97 -> 0.49 for the int8 draft."""
        n = len(self.train_pool)
        idx = torch.randint(n, (min(self.cfg.batch_positions, n),), generator=self.gen).tolist()
        h, labels = self.train_pool.batch(idx)
        base = self.model.head_logits(h.to(self.model.dtype), adapted=False)  # frozen: no graph
        with torch.enable_grad():
            loss = F.cross_entropy(base + self.candidate(h), labels)
            self._opt.zero_grad(set_to_none=True)
            loss.backward()
            self._opt.step()
        self._steps_left -= 1

    def _eval_first(self) -> int:
        """The first held-out row a cycle scores: only the newest eval_recent (the pool is oldest first), so
        an adapter is judged on the traffic it will serve, not on the domain before a switch."""
        return max(0, len(self.eval_pool) - self.cfg.eval_recent)

    @torch.no_grad()
    def _eval_step(self) -> tuple[float, float] | None:
        rows = list(range(self._eval_at, min(len(self.eval_pool), self._eval_at + self.cfg.eval_chunk)))
        if rows:
            h, labels = self.eval_pool.batch(rows)
            base = self.model.head_logits(h.to(self.model.dtype), adapted=False)
            serving = self.model.adapter
            pred_serving = (base + serving(h) if serving is not None else base).argmax(-1)
            pred_cand = (base + self.candidate(h)).argmax(-1)
            c = self._eval_counts
            c[0] += len(rows)
            c[1] += int((pred_serving == labels).sum())
            c[2] += int((pred_cand == labels).sum())
            self._eval_at = rows[-1] + 1
        if self._eval_at < len(self.eval_pool):
            return None
        n, right_serving, right_cand = self._eval_counts
        self.last_eval = (right_serving / max(1, n), right_cand / max(1, n))
        return self.last_eval
