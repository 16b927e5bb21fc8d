"""Batched greedy drafting over a ragged KV cache.

Each sequence keeps the tokens whose KV is cached (`cached`) and the verified tokens the target has told it
about (`verified`). Before drafting, the KV is rolled back to their longest common prefix (accepted drafts
keep their KV) and extended with the verified tokens not yet cached: the catch-up prefill, which after
speculation-free steps covers every token generated meanwhile (Nightjar's switching cost, in `stats`).

Drafting is split into jobs (one per sequence and round) that advance one forward pass at a time: `start()`
records a round's deltas and returns its jobs, `advance()` runs one pass over any set of jobs. The compute
loop lets a round that arrives mid-way join the very next pass (iteration-level batching); `propose()` is
start + advance until done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence

from draft_server.draft_job import DraftJob, DraftSeq, DraftStats, logit_rows, tree_row
from draft_server.fanout import top_two
from draft_server.kv_pool import MIN_LENGTH, MIN_SLOTS, DraftKVCache, pass_tokens
from draft_server.lookahead import Lookahead
from draft_server.prompt_seeding import PromptSeeding
from draft_server.tree_draft import BeamTree, fit_width
from starjar.model.grouped_forward import grouped_forward
from starjar.model.loading import LoadedModel
from starjar.spec.proposer import DraftReply, DraftRequest
from starjar.spec.token_ids import common_prefix, first_out_of_range

SHORT_FEED = 8  # feeds up to this many tokens share one pass whatever their padding
# A long catch-up (a new sequence's prompt) is fed in chunks, and a pass holds at most this many fed tokens:
# a pass's masks and attention scores grow with its tokens x its context, and must stay bounded.
MAX_FEED = 512


class DraftEngine(PromptSeeding):
    """Implements starjar.spec.proposer.Proposer in process."""

    def __init__(self, model: LoadedModel, max_sequences: int = 256, auto_reload: bool = True,
                 max_kv_tokens: int | None = None, max_kv_tokens_per_owner: int | None = None,
                 on_reload: Callable[[float], None] | None = None):
        """`max_kv_tokens` bounds the cache's size in tokens (live slots x the longest; the cache is a
        rectangle), `max_kv_tokens_per_owner` the tokens one owner holds (a seq_id (owner, id) is owned by
        its first element: on the draft server, the target's tag). A sequence that would break either is
        answered resync and dropped. on_reload(seconds): told how long each reload took (a metric)."""
        self.model = model
        self.max_kv_tokens = max_kv_tokens
        self.max_kv_tokens_per_owner = max_kv_tokens_per_owner
        self.max_pass_tokens = pass_tokens(model, max_kv_tokens, SHORT_FEED)
        # K and V copied per layer by a pass over scattered slots: a fortieth of the budget's (all layers') bytes.
        layers = model.model.config.num_hidden_layers
        self.max_gather_cells = None if max_kv_tokens is None else max(1, max_kv_tokens * layers // 40)
        self.cache = self._new_cache()
        self.max_sequences = max_sequences
        self._seqs: dict[Hashable, DraftSeq] = {}
        self._owner_tokens: dict[Hashable, int] = {}
        self._longest = 0  # the longest sequence's verified tokens, as of the round being started
        self._held = 0  # the longest row a stage may grow to, as of the round being started
        self.over_budget = 0  # sequences answered resync for the KV budget
        self.stats = DraftStats()
        self.ahead = Lookahead(self.stats)  # draft_server.lookahead: work ahead of the next rounds
        self.prefill_ahead = False  # a round with gamma 0 has its tokens fed in idle time (lookahead on)
        # Offload (Nightjar section 6): weights to host memory and all KV dropped while nobody speculates.
        self.auto_reload = auto_reload  # propose() while offloaded starts the reload itself
        self.on_reload, self.offloads, self.reloads = on_reload, 0, []
        self._offloaded = False
        self._reloader: threading.Thread | None = None

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    # ---- offload --------------------------------------------------------------------------

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.model.model.parameters(), *self.model.model.buffers()))

    def offload(self) -> None:
        """Drop every sequence (their next rounds get resync answers) and move the weights to host memory (on a
        CPU-only machine they are already there: only the KV is freed). Call from the thread that runs propose()."""
        if self._offloaded:
            return
        self._seqs.clear()
        self.ahead.clear()
        self._owner_tokens.clear()
        self.cache = self._new_cache()
        if self.model.device.type != "cpu":
            import torch

            if self.model.graphs is not None:
                self.model.graphs.drop()  # they read the weights where they were
            self.model.model.to("cpu")
            torch.cuda.empty_cache()
        self._offloaded = True
        self.offloads += 1

    def start_reload(self) -> bool:
        """Bring the weights back on a background thread; never blocks. True if a reload started."""
        if not self._offloaded or (self._reloader is not None and self._reloader.is_alive()):
            return False

        def reload() -> None:
            t0 = time.perf_counter()
            self.model.model.to(self.model.device)
            took = time.perf_counter() - t0
            self.reloads.append(took)
            self._offloaded = False  # last: propose() keeps answering resync until the weights are back
            if self.on_reload is not None:
                self.on_reload(took)

        self._reloader = threading.Thread(target=reload, name="draft-reload", daemon=True)
        self._reloader.start()
        return True

    def wait_reloaded(self, timeout: float = 60.0) -> bool:
        if self._reloader is not None:
            self._reloader.join(timeout)
        return not self._offloaded

    # ---- proposing ------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftReply]:
        replies, jobs = self.start(requests)
        live = [j for _, j in jobs]
        while live:
            self.advance(live)
            live = [j for j in live if not j.done]
        for i, job in jobs:
            replies[i] = job.reply()
        return replies

    def start(self, requests: Sequence[DraftRequest]) -> tuple[list[DraftReply], list[tuple[int, DraftJob]]]:
        """Record a round's deltas. Returns the replies known now (None = resync, [] = nothing to draft) and
        (request index, job) for the sequences that want drafts; their replies are the jobs' drafts once done.
        A sequence must not be started again while a job of it is unfinished."""
        if self._offloaded:  # no drafts meanwhile: every sequence resyncs once the weights are back
            if self.auto_reload and not all(r.prompt_kv for r in requests):  # a prompt handed over asks no drafts
                self.start_reload()
            self.stats.resyncs += len(requests)
            return [None] * len(requests), []
        self.stats.rounds += 1
        replies: list[DraftReply] = [None] * len(requests)
        jobs: list[tuple[int, DraftJob]] = []
        self._longest = max((len(q.verified) for q in self._seqs.values()), default=0)
        self._held = self.ahead.extent()  # once a round: claims only shorten it, so it stays an upper bound
        for i, req in enumerate(requests):
            if req.prompt_kv:  # a prompt's part with the target's KV: taken, never fed
                replies[i] = [] if self.take_kv(req) else None
                self.stats.resyncs += replies[i] is None
                continue
            stage = self.ahead.claim(req, self.cache)
            seq = self._record(req)
            if seq is None:
                self.stats.resyncs += 1
                continue
            replies[i] = []
            gamma = min(req.gamma, self.model.max_context - len(seq.verified))
            if stage is not None and stage.seq is seq and seq.cached:  # a lookahead hit: its drafts are kept
                jobs += [(i, job)] if (job := self.ahead.take(stage, gamma, self.cache)) is not None else []
            elif gamma > 0 and seq.verified:
                # Catch-up: roll back to the common prefix (at least one token must be fed to get logits).
                read = seq.read
                keep = min(common_prefix(seq.cached, read), len(read) - 1)
                self.cache.truncate(seq.slot, keep)
                del seq.cached[keep:]
                width = fit_width(gamma, req.tree_width) if req.tree_width > 1 else 1
                beam = BeamTree(gamma, width) if width > 1 else None
                jobs.append((i, DraftJob(req.seq_id, seq, gamma, read[keep:], beam=beam)))
                self.stats.catchup_tokens += len(read) - keep
            elif self.prefill_ahead and seq.verified:  # only recorded: its prompt is fed ahead, in idle time
                self.ahead.ingest(req, seq)
        return replies, jobs

    def advance(self, jobs: Sequence[DraftJob]) -> None:
        """One forward pass for every unfinished job: each gains one draft token, or feeds the next chunk of its
        catch-up (at most its `allow`)."""
        live = [j for j in jobs if not j.done]
        # A new sequence's whole prompt goes in its own pass; a usual round's catch-up (accepted drafts + the
        # bonus token) is short enough to ride with the one-token steps.
        cap = min(MAX_FEED, self.max_pass_tokens)
        if any(len(j.feed) > cap for j in live):  # a prompt over several passes: the cache grows once, up front
            self.cache.reserve(max(self.cache.lengths[j.seq.slot] + len(j.feed) + j.gamma for j in live))

        def chunk(j: DraftJob) -> list[int]:
            # A tree job's beam pass feeds all its beams at once; only a catch-up may be cut.
            return j.feed if j.beam is not None and j.passes else j.feed[:min(cap, j.allow or cap)]

        for step in grouped_forward(self.model, self.cache, live, chunk, lambda j: j.seq.slot,
                                    short=SHORT_FEED, max_pass_tokens=self.max_pass_tokens,
                                    tree=tree_row, last=logit_rows, max_gather_cells=self.max_gather_cells):
            if all(j.passes == 0 for j in step.rows):
                self.stats.catchup_s += step.seconds
            else:
                self.stats.step_s += step.seconds
                self.stats.steps += 1
            self.stats.passes += 1
            for j, f, lg in zip(step.rows, step.feeds, step.logits, strict=True):
                if j.beam is not None and j.passes:
                    self._grow_tree(j, lg)
                    continue
                if j.branch is None:  # a branch's KV lies past the sequence's own (draft_server.fanout)
                    j.seq.cached.extend(f)
                if len(f) < len(j.feed):  # a chunk of a long catch-up: no draft until it is all in
                    j.feed = j.feed[len(f):]
                    continue
                if j.beam is not None:
                    self._grow_tree(j, lg)
                    continue
                if self.ahead.branches:  # fanout: the drafts' probabilities choose the rejections to branch on
                    token, top = top_two(lg[0])
                    j.tops.append(top)
                else:
                    token = int(lg[0].argmax())
                j.drafts.append(token)
                j.feed = [token]
                j.passes += 1
                self.stats.drafted_tokens += 1

    def _grow_tree(self, j: DraftJob, logits) -> None:
        """A tree job's pass is done: its scored nodes' children join the tree; when the tree is complete the
        cache goes back to the verified prefix (only the beams were written past it)."""
        j.beam.expand(logits)
        j.passes += 1
        j.feed = j.beam.feed()
        if j.beam.done:
            self.cache.truncate(j.seq.slot, len(j.seq.cached))
            self.stats.tree_jobs += 1
            self.stats.tree_nodes += len(j.beam.tokens)
            self.stats.tree_expand_s += j.beam.expand_s
            self.stats.drafted_tokens += len(j.beam.tokens)

    # ---- lookahead (draft_server.lookahead) ---------------------------------------------------

    def stage(self, job: DraftJob, push: Callable | None = None) -> bool:
        """Start drafting ahead for a finished chain job whose drafts were just answered; whether it did (a
        sequence gone, a tree, or no room in the context or the KV budgets: no)."""
        g, b = len(job.drafts), self.ahead.branches
        if job.beam is not None or not job.done or g == 0 or not self.stage_fits(job, 2 * g + 1):
            return False
        b = b if b and self.stage_fits(job, (g + 1) * (b + 2) - 1) else 0  # 0: room for the chain, not branches
        self.ahead.stage(job, self.cache, push, b)
        return True

    def stage_fits(self, job: DraftJob, ahead: int) -> bool:
        """Whether job's sequence, still held, may hold `ahead` tokens past its verified ones (context, budgets)."""
        seq, n = job.seq, len(job.seq.verified)
        return self._seqs.get(job.seq_id) is seq and bool(seq.cached) and n + ahead <= self.model.max_context and \
            self._fits(DraftRequest(job.seq_id, n, [], 0), seq, n + ahead)

    def advance_lookahead(self, jobs: Sequence[DraftJob]) -> int:
        """One pass for jobs ahead (ahead.jobs(), none started since); the tokens drafted (an ingest's fed ones are
        prefilled ahead). An ingest done becomes its first round's stage."""
        drafted, t0 = self.stats.drafted_tokens, time.perf_counter()
        ingests = [(j, len(j.seq.cached), len(j.drafts)) for j in jobs if self.ahead.ingests.get(j.seq_id) is j]
        self.advance(jobs)
        for j in (j for j, *_ in ingests if j.done and self.stage_fits(j, self.ahead.gamma + 1)):
            self.ahead.stage_ingested(j)
        if any(j.branch is not None for j in jobs):
            self.ahead.clock.passed(time.perf_counter() - t0)
        self.stats.lookahead_prefilled += sum(len(j.seq.cached) - n for j, n, _ in ingests)
        # An ingest's one draft is never sent: drafted ahead means drafts a stage may answer with.
        drafted = self.stats.drafted_tokens - drafted - sum(len(j.drafts) - d for j, _, d in ingests)
        self.stats.lookahead_drafted += drafted
        return drafted

    def release(self, seq_ids: Sequence[Hashable]) -> None:
        for sid in seq_ids:
            self.ahead.drop(sid)
            seq = self._seqs.pop(sid, None)
            if seq is None:
                continue
            self._count(sid, -len(seq.verified))
            self.cache.free(seq.slot)  # keeps the slot of the sequence it moves current

    def owner_tokens(self, owner: Hashable) -> int:
        return self._owner_tokens.get(owner, 0)

    # ---- internals ------------------------------------------------------------------------

    def _new_cache(self) -> DraftKVCache:
        return DraftKVCache(self.model.device, self.model.cache_dtype, self.max_kv_tokens)

    def shrink_cache(self) -> bool:
        """Give back KV memory a burst left: when what the live sequences hold, with room to double in slots
        and in length, is at most a quarter of the cache, reallocate it to that. Call between passes (no job
        in flight). Whether it shrank."""
        slots, length = self.cache.capacity
        want_slots = max(MIN_SLOTS, _power_of_two(2 * self.cache.num_slots))
        want_length = max(MIN_LENGTH, _power_of_two(2 * max(self.cache.lengths, default=0)))
        if 4 * want_slots * want_length > slots * length or not self.cache.shrink(want_slots, want_length):
            return False
        if self.model.device.type == "cuda":  # else the freed buffers stay with torch's caching allocator
            import torch

            torch.cuda.empty_cache()
        return True

    def _record(self, req: DraftRequest) -> DraftSeq | None:
        """Apply a delta; None when the prefix before req.start is unknown (resync: the target resends the
        sequence from 0, so what is kept of it now is dropped) or the sequence breaks a limit."""
        seq = self._seqs.get(req.seq_id)
        if seq is not None and req.start > len(seq.verified):
            self.release([req.seq_id])
            return None
        new_len = req.start + len(req.tokens)
        if not self._admits(req, seq, new_len, self._held):
            self.over_budget += 1
            self.release([req.seq_id])
            return None
        if seq is None:
            if req.start != 0 or len(self._seqs) >= self.max_sequences:
                return None
            seq = DraftSeq(slot=-1, seq_id=req.seq_id)
            self.cache.allocate(seq)
            self._seqs[req.seq_id] = seq
        self._count(req.seq_id, new_len - len(seq.verified))
        skipped = seq.verified[req.start:seq.skip]  # a delta that rewrites what the draft skipped starts it over
        del seq.verified[req.start:]
        seq.verified.extend(int(t) for t in req.tokens)
        if not seq.cached or seq.verified[req.start:seq.skip] != skipped:
            self._window(seq)
        if len(seq.verified) > self.model.max_context or (
                first_out_of_range(req.tokens, self.model.vocab_size) is not None):
            self.release([req.seq_id])
            return None
        self._longest = max(self._longest, len(seq.verified))
        return seq

    def _window(self, seq: DraftSeq) -> None:
        """Where the draft starts reading a sequence it holds nothing of yet: the prompt's last prompt_window
        tokens (positions restart at 0 there: rotary attention depends only on distances)."""
        # TIDE's tap reports cache positions as sequence positions: a windowed sequence would misalign them.
        window = self.model.prompt_window if self.model.hidden_tap is None else None
        seq.skip = max(0, len(seq.verified) - window) if window else 0
        seq.cached.clear()
        self.cache.truncate(seq.slot, 0)

    def _admits(self, req: DraftRequest, seq: DraftSeq | None, new_len: int, held: int) -> bool:
        """_fits for real work: where only the rows staged ahead (up to `held` long) break the budget, they go."""
        if not self._fits(req, seq, new_len):
            return False
        if held and not self._fits(req, seq, new_len, held):
            self.ahead.give_way(self.cache)
            self._held = 0  # nothing is staged now
        return True

    def _fits(self, req: DraftRequest, seq: DraftSeq | None, new_len: int, held: int = 0) -> bool:
        """Whether the cache stays within the budgets once this sequence holds new_len tokens + its drafts, the
        cache's rows as long as the longest of those and `held` (rows staged ahead may grow to)."""
        extra = req.gamma + 1 if req.tree_width <= 1 else 1 + (req.gamma - 1) * req.tree_width
        need = new_len + extra
        if self.max_kv_tokens is not None:
            rows = len(self._seqs) + (seq is None)
            if rows * max(max(self._longest, new_len) + extra, held) > self.max_kv_tokens:
                return False
        if self.max_kv_tokens_per_owner is not None:
            old = len(seq.verified) if seq is not None else 0
            if self.owner_tokens(_owner(req.seq_id)) - old + need > self.max_kv_tokens_per_owner:
                return False
        return True

    def _count(self, seq_id: Hashable, delta: int) -> None:
        owner = _owner(seq_id)
        left = self._owner_tokens.get(owner, 0) + delta
        if left > 0:
            self._owner_tokens[owner] = left
        else:
            self._owner_tokens.pop(owner, None)


def _power_of_two(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _owner(seq_id: Hashable) -> Hashable:
    return seq_id[0] if isinstance(seq_id, tuple) else None
