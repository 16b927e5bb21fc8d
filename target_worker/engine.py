"""The target engine: continuous batching with exact speculative verification.

One `step()` is three calls with three owners:
  schedule    the Scheduler admits waiting requests (batch size, KV budget);
  run         newcomers are prefilled (their first token), then every other
              running sequence takes one decoding step: the policy picks gamma
              for the batch size, the proposer drafts, and one ragged forward
              pass over gamma_i + 1 positions per sequence scores all drafts;
  postprocess speculative sampling accepts a prefix of each draft plus one
              recovered or bonus token, rejected KV is rolled back, stop rules
              are applied and finished sequences leave.

Invariant: a running sequence's KV holds every token but its last one (the
"pending" token), which is the first input of its next step.

The proposer is only an optimisation: if it fails, answers late or answers
nonsense, the affected sequences decode that step without drafts, and the
output is exactly what it would have been.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from starjar.batching import length_groups
from starjar.errors import InvalidArgument
from starjar.models import LoadedModel
from starjar.policy import FixedGamma, SpeculationPolicy
from starjar.proposer import DraftRequest, Proposer
from starjar.sampling import SamplingParams
from starjar.token_ids import check_token_ids, first_out_of_range
from starjar.verify import sample_next, verify
from target_worker.request import Request, Status
from target_worker.scheduler import Scheduler

log = logging.getLogger(__name__)

MAX_GAMMA = 16


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16
    kv_budget_tokens: int | None = None  # None: max_batch_size full contexts
    max_gamma: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 4096:
            raise InvalidArgument("max_batch_size", "must be in [1, 4096]", self.max_batch_size)
        if not 0 <= self.max_gamma <= MAX_GAMMA:
            raise InvalidArgument("max_gamma", f"must be in [0, {MAX_GAMMA}]", self.max_gamma)
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 16:
            raise InvalidArgument("kv_budget_tokens", "must be >= 16", self.kv_budget_tokens)


@dataclass
class StepTally:
    """Decode steps of one kind: how many, their time and the tokens they emitted."""
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    spec_rounds: int = 0  # sequence-rounds that carried drafts
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    prefill_s: float = 0.0
    propose_s: float = 0.0
    verify_s: float = 0.0
    proposer_failures: int = 0
    resyncs: int = 0
    preemptions: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_GAMMA)
    # Decode steps split three ways: drafts verified (spec), none asked for (plain), asked for and none came
    # (fallback: refusal, deadline, resync). The controller's admission model and saturation guard compare
    # tokens per second of step time with and without speculation; plain is decoding alone, untouched by a
    # failed draft round.
    spec: StepTally = field(default_factory=StepTally)
    plain: StepTally = field(default_factory=StepTally)
    fallback: StepTally = field(default_factory=StepTally)

    @property
    def spec_steps(self) -> int:  # decode steps where at least one sequence had drafts
        return self.spec.steps

    def step_kinds(self) -> dict:
        """The three tallies as flat fields: spec_steps, spec_step_s, spec_tokens, plain_..., fallback_..."""
        return {f"{kind}_{key}": value for kind in ("spec", "plain", "fallback")
                for key, value in (("steps", getattr(self, kind).steps), ("step_s", getattr(self, kind).seconds),
                                   ("tokens", getattr(self, kind).tokens))}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per speculative sequence-round: accepted drafts + 1."""
        return (self.accepted_tokens + self.spec_rounds) / self.spec_rounds if self.spec_rounds else 0.0


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request. `finished` is a snapshot taken in that step:
    consumers on other threads read it later, after the request may have moved on."""

    request: Request
    new_token_ids: list[int]
    finished: bool = False
    error: str | None = None  # the step failed: this request ends with it (INTERNAL), the engine goes on


class TargetEngine:
    def __init__(self, model: LoadedModel, proposer: Proposer | None = None,
                 policy: SpeculationPolicy | None = None, config: EngineConfig | None = None):
        self.model = model
        self.proposer = proposer
        self.config = config or EngineConfig()
        self.policy = policy or FixedGamma(0)
        budget = self.config.kv_budget_tokens or self.config.max_batch_size * model.max_context
        self.cache = model.new_cache()
        self.scheduler = Scheduler(self.config.max_batch_size, budget, self.config.max_gamma + 1)
        # One sequence may hold at most this many tokens (prompt + output).
        self.max_seq_tokens = min(model.max_context, budget - self.config.max_gamma - 1)
        self.stats = EngineStats()
        self.step_listener: Callable[[int, int], None] | None = None  # (batch size, gamma) per decode step
        self.elastic = None  # ElasticKV, for a co-located draft that lends its memory to the KV cache

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        req = Request(prompt_ids=list(prompt_ids), params=params)
        if request_id is not None:
            req.request_id = request_id
        return self.enqueue(req)

    def enqueue(self, req: Request) -> Request:
        req.prompt_ids = self.validate_prompt(req.prompt_ids)
        req.params.validate(self.model.vocab_size)
        eos = () if req.params.ignore_eos else self.model.eos_token_ids
        req.stop_ids = frozenset(req.params.stop_token_ids) | frozenset(eos)
        self.scheduler.add(req)
        return req

    def validate_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidArgument("prompt", "must contain at least 1 token")
        limit = self.max_seq_tokens - 1
        if len(prompt) > limit:
            raise InvalidArgument("prompt", f"at most {limit} tokens (context {self.model.max_context}, "
                                  "one token left to generate)", f"{len(prompt)} tokens")
        check_token_ids("prompt_token_ids", prompt, self.model.vocab_size)
        return prompt

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
        """After a step raised: end every running request with `reason` and free its KV. Waiting requests
        keep their place; the next step starts from a clean cache state."""
        failed = list(self.scheduler.running)
        for req in failed:
            self._retire(req)
            req.finish_reason = "error"
        return [StepOutput(req, [], finished=True, error=reason) for req in failed]

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self.stats.steps += 1
        if self.elastic is not None:
            self.elastic.before_step()
        joined = self.scheduler.admit(self.cache.tokens_used())
        outputs: dict[int, StepOutput] = {}
        if joined:
            self._prefill(joined, outputs)
        decoding = [r for r in self.scheduler.running if r not in joined and not r.finished]
        if decoding:
            self._decode(decoding, outputs)
        return list(outputs.values())

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_step: Callable[[list[StepOutput]], None] | None = None) -> list[Request]:
        """Run prompts to completion; returns the requests in input order."""
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work():
            out = self.step()
            if on_step:
                on_step(out)
        return reqs

    # ---- run: prefill ---------------------------------------------------------------------

    def _prefill(self, joined: list[Request], outputs: dict[int, StepOutput]) -> None:
        t0 = time.perf_counter()
        for req in joined:
            self.cache.allocate(req)
        # A readmitted (preempted) request already holds its pending token: feed all but it.
        feeds = {id(r): (r.all_ids()[:-1] if r.output_ids else r.prompt_ids) for r in joined}
        for group in length_groups(joined, lambda r: len(feeds[id(r)])):
            group.sort(key=lambda r: r.slot)  # contiguous slots let the cache use views
            fs = [feeds[id(r)] for r in group]
            logits = self.model.forward(self.cache, [r.slot for r in group], fs, [[len(f) - 1] for f in fs])
            now = time.perf_counter()
            for req, lg in zip(group, logits):
                if not req.output_ids:
                    req.first_token_s = now
                    self._emit(req, [sample_next(lg[0], req.params, req.generator)], outputs)
        self.stats.prefill_s += time.perf_counter() - t0

    # ---- run: one decoding step (speculative when gamma > 0) ------------------------------

    def _decode(self, batch: list[Request], outputs: dict[int, StepOutput]) -> None:
        gamma = min(self.policy.choose(len(batch)), self.config.max_gamma) if self.proposer else 0
        if self.step_listener is not None:
            self.step_listener(len(batch), gamma)
        gammas = [self._cap_gamma(r, gamma) for r in batch]
        batch, gammas = self._fit_budget(batch, gammas)
        if not batch:
            return
        batch_order = sorted(range(len(batch)), key=lambda i: batch[i].slot)  # contiguous slots -> views
        batch = [batch[i] for i in batch_order]
        gammas = [gammas[i] for i in batch_order]
        step_start = time.perf_counter()
        drafts = self._propose(batch, gammas)
        t0 = time.perf_counter()
        feeds = [[r.output_ids[-1]] + d for r, d in zip(batch, drafts)]
        logits = self.model.forward(self.cache, [r.slot for r in batch], feeds,
                                    [list(range(len(f))) for f in feeds])
        tokens = accepted = drafted = 0
        for req, d, lg in zip(batch, drafts, logits):
            kv_before = req.num_tokens - 1
            verdict = verify(lg, d, req.params, req.generator)
            # KV now holds the pending token and every draft; keep it and the accepted ones.
            self.cache.truncate(req.slot, kv_before + 1 + verdict.num_accepted)
            if d:
                self.stats.spec_rounds += 1
                for pos in range(verdict.num_accepted):
                    self.stats.accepted_per_position[pos] += 1
            accepted += verdict.num_accepted
            drafted += len(d)
            req.drafted_tokens += len(d)
            req.accepted_tokens += verdict.num_accepted
            tokens += self._emit(req, verdict.tokens, outputs)
        now = time.perf_counter()
        self.stats.verify_s += now - t0
        self.stats.decode_steps += 1
        # Drafts asked for and none came: the cost of trying, not plain decoding.
        kind = self.stats.spec if drafted else self.stats.fallback if any(gammas) else self.stats.plain
        kind.add(now - step_start, tokens)
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        # The policy sees the whole step, drafting included: that is what gamma trades off. A step whose
        # drafts failed (a missed deadline, a broken stream) is neither: it would make plain decoding look
        # as slow as the wait, so it is kept out of the policy's statistics.
        if kind is not self.stats.fallback:
            self.policy.observe(len(batch), gamma if drafted else 0, now - step_start, tokens, accepted, drafted)
        if self.elastic is not None:
            self.elastic.after_decode(gamma)

    def _cap_gamma(self, req: Request, gamma: int) -> int:
        """No drafts past max_tokens or past the sequence's token limit."""
        left_out = req.params.max_tokens - len(req.output_ids) - 1
        left_ctx = self.max_seq_tokens - req.num_tokens - 1
        return max(0, min(gamma, left_out, left_ctx))

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

    def _propose(self, batch: list[Request], gammas: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in batch]
        want = [i for i, g in enumerate(gammas) if g > 0]
        if not want:
            return drafts
        reqs = []
        for i in want:
            r = batch[i]
            ids = r.all_ids()
            reqs.append(DraftRequest(r.draft_key, r.draft_synced, ids[r.draft_synced:], gammas[i]))
        t0 = time.perf_counter()
        try:
            replies = self.proposer.propose(reqs)
            if len(replies) != len(reqs):
                raise ValueError(f"proposer answered {len(replies)} of {len(reqs)} sequences")
        except Exception as exc:  # the draft is an optimisation: never let it fail a request
            self.stats.proposer_failures += 1
            log.debug("proposer failed, decoding this step without drafts: %s", exc)
            for i in want:
                batch[i].draft_synced = 0
            return drafts
        finally:
            self.stats.propose_s += time.perf_counter() - t0
        vocab = self.model.vocab_size
        for i, dreq, reply in zip(want, reqs, replies):
            r = batch[i]
            if reply is None:
                self.stats.resyncs += 1
                r.draft_synced = 0
                continue
            r.draft_synced = dreq.start + len(dreq.tokens)
            reply = [int(t) for t in reply[: gammas[i]]]
            if first_out_of_range(reply, vocab) is not None:
                self.stats.proposer_failures += 1
                continue
            drafts[i] = reply
        return drafts

    # ---- postprocess ----------------------------------------------------------------------

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
        req.draft_synced = 0
        if self.proposer is not None:
            try:
                self.proposer.release([req.draft_key])
            except Exception as exc:
                log.warning("proposer release failed: %s", exc)
