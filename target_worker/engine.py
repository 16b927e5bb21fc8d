"""The target engine: continuous batching with exact speculative verification.

One `step()` is three calls with three owners:
  schedule    the Scheduler admits waiting requests (batch size, KV budget);
  run         newcomers are prefilled (their first token), then every other running sequence takes one step:
                plan     the policy picks gamma for the batch size, capped per sequence; the newest are
                         preempted if the KV would overflow;
                propose  the proposer drafts up to gamma tokens per sequence;
                score    one ragged forward pass over gamma_i + 1 positions per sequence; speculative sampling
                         accepts a prefix of each draft plus one recovered or bonus token (the verdicts), and
                         rejected KV is rolled back;
  postprocess the verdicts' tokens are emitted up to the stop rules, finished sequences leave, the policy sees it.

Invariant: a running sequence's KV holds every token but its last one (the "pending" token), its next input.
The proposer is only an optimisation: if it fails, answers late or answers nonsense, the affected sequences
decode that step without drafts, and the output is exactly what it would have been.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from starjar.errors import InvalidArgument
from starjar.model.grouped_forward import forward_pass, grouped_forward
from starjar.model.loading import LoadedModel
from starjar.spec.draft_cap import check_max_draft_tokens
from starjar.spec.policy import FixedGamma, SpeculationPolicy
from starjar.spec.proposer import DraftRequest, Proposer
from starjar.spec.sampling import SamplingParams
from starjar.spec.token_tree import TokenTree
from starjar.spec.verify import sample_next, verify
from target_worker.catch_up_meter import catch_up_meter, report_catch_up
from target_worker.decode_plan import DecodePlan, SeqRound
from target_worker.elastic_kv import ElasticKV
from target_worker.prompt_ahead import SeedDraft, SendAhead, seed_prompts, send_prompts_ahead
from target_worker.prompt_check import check_prompt
from target_worker.request import Request, Status
from target_worker.scheduler import Scheduler
from target_worker.stats import MAX_GAMMA, EngineStats
from target_worker.tree_score import TreeConfig, TreeSelector, as_tree, score_rounds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16
    kv_budget_tokens: int | None = None  # None: max_batch_size full contexts
    max_gamma: int = 8
    tree: TreeConfig | None = None  # token trees (AdaServe) instead of chains; None: chains

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 4096:
            raise InvalidArgument("max_batch_size", "must be in [1, 4096]", self.max_batch_size)
        if not 0 <= self.max_gamma <= MAX_GAMMA:
            raise InvalidArgument("max_gamma", f"must be in [0, {MAX_GAMMA}]", self.max_gamma)
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 16:
            raise InvalidArgument("kv_budget_tokens", "must be >= 16", self.kv_budget_tokens)


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request; `finished` is a snapshot (other threads read it later)."""

    request: Request
    new_token_ids: list[int]
    finished: bool = False
    error: str | None = None  # the step failed: this request ends with it (INTERNAL), the engine goes on


class TargetEngine:
    def __init__(self, model: LoadedModel, proposer: Proposer | None = None,
                 policy: SpeculationPolicy | None = None, config: EngineConfig | None = None,
                 elastic: ElasticKV | None = None):
        """elastic: for a co-located draft that lends its memory to the KV cache while nobody speculates."""
        self.model = model
        self.proposer = proposer
        self.config = config or EngineConfig()
        self.policy = policy or FixedGamma(0)
        budget = self.config.kv_budget_tokens or self.config.max_batch_size * model.max_context
        self.cache = model.new_cache()
        self.scheduler = Scheduler(self.config.max_batch_size, budget, self.config.max_gamma + 1)
        # Tokens one sequence may hold (prompt + output), as the model alone: _cap_gamma keeps drafts within it.
        self.max_seq_tokens = min(model.max_context, budget)
        self.stats = EngineStats()
        self.step_listener: Callable[[int, int], None] | None = None  # (batch size, gamma) per decode step
        self.send_ahead: SendAhead | None = None  # a remote proposer's: new prompts to the draft first
        self.seed_draft: SeedDraft | None = None  # a co-located draft's: new prompts with the target's KV
        self.elastic = elastic
        self.trees = TreeSelector(self.config.tree) if self.config.tree is not None else None
        self._outputs: dict[int, StepOutput] = {}  # the step in flight's, by request id

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    max_draft_tokens: int | None = None) -> Request:
        """max_draft_tokens: the request's own cap on drafts per step (0: the target alone; None: the policy's)."""
        req = Request(prompt_ids=list(prompt_ids), params=params, max_draft_tokens=max_draft_tokens)
        if request_id is not None:
            req.request_id = request_id
        return self.enqueue(req)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The one check of a request entering this engine: its prompt (as ints) within the context and the
        vocabulary, and its sampling values; InvalidArgument names the field."""
        params.validate(self.model.vocab_size)
        return self.validate_prompt(prompt_ids)

    def enqueue(self, req: Request, checked: bool = False) -> Request:
        """checked: the request passed check() where it entered the worker (the service), and is not checked
        again here; a request from anywhere else (co-located use, benchmarks) is."""
        if not checked:
            req.prompt_ids = self.check(req.prompt_ids, req.params)
            if req.max_draft_tokens is not None:
                check_max_draft_tokens(req.max_draft_tokens)
        eos = () if req.params.ignore_eos else self.model.eos_token_ids
        req.stop_ids = frozenset(req.params.stop_token_ids) | frozenset(eos)
        self.scheduler.add(req)
        return req

    def validate_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        return check_prompt(prompt_ids, self.max_seq_tokens - 1, self.model.max_context, self.model.vocab_size)

    def abort(self, req: Request) -> None:
        """Drop a request (client went away); frees its KV and draft state."""
        if req.status is Status.WAITING:
            self.scheduler.waiting.remove(req)
            req.status = Status.FINISHED
        elif req.status is Status.RUNNING:
            self._retire(req)
        req.finish_reason = req.finish_reason or "abort"

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def fail_running(self, reason: str) -> list[StepOutput]:
        """After a step raised: end every running request with `reason`, free its KV (waiting ones stay). A
        request the step finished before it raised (already retired) gets its output as it was."""
        failed = list(self.scheduler.running)
        for req in failed:
            self._retire(req)
            req.finish_reason = "error"
        done = [o for o in self._outputs.values() if o.finished]
        return done + [StepOutput(req, [], finished=True, error=reason) for req in failed]

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs = self._outputs = {}  # kept: a step that raises still delivers what it finished
        self.stats.steps += 1
        if self.elastic is not None:
            self.elastic.before_step(self.scheduler, self.cache.tokens_used())
        joined = self.scheduler.admit(self.cache.tokens_used())
        if joined:
            self._prefill(joined, outputs)
        decoding = [r for r in self.scheduler.running if r not in joined and not r.finished]
        plan = self._plan(decoding) if decoding else None
        if plan is not None and plan.rounds:
            self._propose(plan)
            self._score(plan)
            self._postprocess(plan, outputs)
        return list(outputs.values())

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_step: Callable[[list[StepOutput]], None] | None = None) -> list[Request]:
        """Run prompts to completion; returns the requests in input order."""
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=False)]
        while self.has_work():
            out = self.step()
            if on_step:
                on_step(out)
        return reqs

    # ---- run: prefill ---------------------------------------------------------------------

    def _prefill(self, joined: list[Request], outputs: dict[int, StepOutput]) -> None:
        send_prompts_ahead(self.send_ahead, joined)
        t0 = time.perf_counter()
        for req in joined:
            self.cache.allocate(req)
        # A readmitted (preempted) request already holds its pending token: feed all but it.
        feeds = {id(r): (r.all_ids()[:-1] if r.output_ids else r.prompt_ids) for r in joined}
        for done in grouped_forward(self.model, self.cache, joined, lambda r: feeds[id(r)], lambda r: r.slot):
            now = time.perf_counter()
            for req, lg in zip(done.rows, done.logits, strict=True):
                if not req.output_ids:
                    req.first_token_s = now
                    self._emit(req, [sample_next(lg[0], req.params, req.draws, req.num_tokens)], outputs)
        elapsed = time.perf_counter() - t0
        self.stats.prefill_s += elapsed
        seed_prompts(self.seed_draft, self.cache, joined, feeds)
        if self.proposer is not None:  # a catch-up's prior
            self.policy.observe_target_prefill(sum(map(len, feeds.values())), elapsed)

    # ---- run: one decoding step (speculative when gamma > 0) ------------------------------

    def _plan(self, decoding: list[Request]) -> DecodePlan:
        """Gamma for this batch size, capped per sequence; the newest preempted until the step fits the KV."""
        if self.proposer is not None:  # a sequence capped at 0 drafts never catches the draft up
            spec = [r for r in decoding if r.max_draft_tokens != 0]
            self.policy.note_draft_lag([r.draft_lag() for r in spec], [r.tokens_left() for r in spec])
        gamma = min(self.policy.choose(len(decoding)), self.config.max_gamma) if self.proposer else 0
        if self.step_listener is not None:
            self.step_listener(len(decoding), gamma)
        batch, gammas = self._fit_budget(decoding, [self._cap_gamma(r, gamma) for r in decoding])
        rounds = sorted((SeqRound(r, g) for r, g in zip(batch, gammas, strict=True)), key=lambda r: r.req.slot)
        return DecodePlan(gamma, rounds)

    def _cap_gamma(self, req: Request, gamma: int) -> int:
        """No drafts past max_tokens, past the sequence's token limit, or past the request's own cap."""
        left_out = req.params.max_tokens - len(req.output_ids) - 1
        left_ctx = self.max_seq_tokens - req.num_tokens - 1
        own = gamma if req.max_draft_tokens is None else req.max_draft_tokens
        return max(0, min(gamma, left_out, left_ctx, own))

    def _fit_budget(self, batch: list[Request], gammas: list[int]) -> tuple[list[Request], list[int]]:
        """Preempt the newest sequences until this step's KV growth fits the budget."""
        budget = self.scheduler.kv_budget_tokens
        while self.cache.tokens_used() + sum(g + 1 for g in gammas) > budget:
            victim = self.scheduler.pick_victim()
            if victim is None:
                gammas = [0] * len(gammas)  # a lone sequence always fits without drafts
                break
            self.stats.preemptions += 1
            log.info("KV budget full: preempting %s", victim.request_id)
            self._drop_kv(victim)
            self.scheduler.preempt(victim)
            if victim in batch:
                i = batch.index(victim)
                batch, gammas = batch[:i] + batch[i + 1:], gammas[:i] + gammas[i + 1:]
        return batch, gammas

    def _propose(self, plan: DecodePlan) -> None:
        """Ask the proposer for the drafts; a failure leaves every round without, a bad reply its own."""
        want = [r for r in plan.rounds if r.gamma > 0]
        if not want:
            return
        shape = self.trees.shape if self.trees is not None else lambda n, g: (g, 0)  # (depth, width) for n
        reqs = [DraftRequest(r.req.draft_key, r.req.draft_synced, r.req.all_ids()[r.req.draft_synced:],
                             *shape(len(want), r.gamma)) for r in want]
        meter = catch_up_meter(self.proposer)
        replies = self._ask_proposer(reqs)
        if replies is None:
            for r in want:
                r.req.draft_synced = 0
            return
        vocab = self.model.vocab_size
        # Only a prompt the draft took (not one held back or answered resync, every step again) was prefilled.
        plan.draft_prefill = any(d.start == 0 and reply is not None for d, reply in zip(reqs, replies, strict=True))
        report_catch_up(self.policy, self.proposer, meter, want, reqs, replies)
        for r, dreq, reply in zip(want, reqs, replies, strict=True):
            if reply is None:
                self.stats.resyncs += 1
                r.req.draft_synced = 0
                continue
            r.req.draft_synced = dreq.start + len(dreq.tokens)
            usable = as_tree(reply, vocab, self._tree_cap(r), r.gamma)
            if usable is None:
                self.stats.proposer_failures += 1
                continue
            r.tree = usable if isinstance(usable, TokenTree) else None
            r.draft = list(usable.tokens) if r.tree is not None else usable
        if self.trees is not None:
            self.trees.select(want)

    def _ask_proposer(self, reqs: list[DraftRequest]) -> list | None:
        """The proposer's replies, one per request; None when it failed."""
        t0 = time.perf_counter()
        try:
            replies = self.proposer.propose(reqs)
            if len(replies) != len(reqs):
                raise ValueError(f"proposer answered {len(replies)} of {len(reqs)} sequences")
            return replies
        except Exception as exc:  # the draft is an optimisation: never let it fail a request
            self.stats.proposer_failures += 1
            log.debug("proposer failed, decoding this step without drafts: %s", exc)
            return None
        finally:
            self.stats.propose_s += time.perf_counter() - t0

    def _tree_cap(self, r: SeqRound) -> int:
        """Nodes a sequence's tree may keep before selection: gamma, or the tree policy's cap while KV has room;
        never more than the request's own cap on draft tokens."""
        if self.trees is None:
            return r.gamma
        room = self.scheduler.kv_budget_tokens - self.cache.tokens_used() - self.num_running * (r.gamma + 1)
        nodes = max(r.gamma, min(self.trees.cfg.cap, r.gamma + max(0, room // max(1, self.num_running))))
        return nodes if r.req.max_draft_tokens is None else min(nodes, r.req.max_draft_tokens)

    def _score(self, plan: DecodePlan) -> None:
        """One pass over each round's pending token and drafts; a verdict per round, rejected KV rolled back."""
        plan.scored_s = time.perf_counter()
        if any(r.tree is not None for r in plan.rounds):
            score_rounds(self.model, self.cache, plan.rounds)
            return
        scored = forward_pass(self.model, self.cache, plan.rounds, lambda r: [r.req.output_ids[-1]] + r.draft,
                              lambda r: r.req.slot, all_logits=True)
        for r, lg in zip(scored.rows, scored.logits, strict=True):
            r.verdict = verify(lg, r.draft, r.req.params, r.req.draws, r.req.num_tokens)
            # KV now holds the pending token and every draft; keep it and the accepted ones.
            self.cache.truncate(r.req.slot, r.req.num_tokens + r.verdict.num_accepted)

    # ---- postprocess ----------------------------------------------------------------------

    def _postprocess(self, plan: DecodePlan, outputs: dict[int, StepOutput]) -> None:
        """Emit the verdicts' tokens, count the step, show it to the policy."""
        tokens = accepted = 0
        for r in plan.rounds:
            self.stats.observe_round(len(r.draft), r.verdict.num_accepted, r.tree is not None)
            r.req.count_round(len(r.draft), r.verdict.num_accepted)
            accepted += r.verdict.num_accepted
            tokens += self._emit(r.req, r.verdict.tokens, outputs)
            if r.gamma and r.req.draft_synced:  # the draft took this step's context: it is in step again
                r.req.spec_through = r.req.num_tokens
        now = time.perf_counter()
        drafted = plan.drafted
        kind = self.stats.observe_step(now - plan.started_s, now - plan.scored_s, tokens, drafted,
                                       any(r.gamma for r in plan.rounds))
        # The policy sees the whole step, drafting included: that is what gamma trades off. A step whose
        # drafts failed (a missed deadline, a broken stream) is neither: it would make plain decoding look
        # as slow as the wait, so it is kept out of the policy's statistics; so is a step that carried a
        # draft prefill (a 700-token prompt's is over a second, and it would land on whichever gamma was on).
        if kind == "fallback":
            pass
        elif plan.draft_prefill:
            self.stats.draft_prefill_steps += 1
        else:
            self.policy.observe(len(plan.rounds), plan.gamma if drafted else 0, now - plan.started_s, tokens,
                                accepted, drafted)
        if self.trees is not None:
            self.trees.observe_step(now - plan.started_s)
        if self.elastic is not None:
            self.elastic.after_decode(plan.gamma, self.scheduler, self.cache.tokens_used())

    def _emit(self, req: Request, new: list[int], outputs: dict[int, StepOutput]) -> int:
        """Append tokens up to the first stop condition; retire the request if it finished."""
        taken = []
        for t in new:
            req.output_ids.append(t)
            taken.append(t)
            if t in req.stop_ids:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.max_seq_tokens:
                req.finish_reason = "length"
            if req.finish_reason:
                break
        self.stats.emitted_tokens += len(taken)
        prev = outputs.get(id(req))
        outputs[id(req)] = StepOutput(req, (prev.new_token_ids if prev else []) + taken,
                                      finished=req.finish_reason is not None)
        if req.finish_reason:
            req.finish_s = time.perf_counter()
            self._retire(req)
        return len(taken)

    def _retire(self, req: Request) -> None:
        self._drop_kv(req)
        self.scheduler.finish(req)

    def _drop_kv(self, req: Request) -> None:
        if req.slot < 0:
            return
        self.cache.free(req.slot)  # keeps the slot of the request it moves current
        req.slot = -1
        req.draft_synced = req.spec_through = 0  # the draft is told to drop it: a readmission lags in full
        if self.proposer is not None:
            try:
                self.proposer.release([req.draft_key])
            except Exception as exc:
                log.warning("proposer release failed: %s", exc)
