"""Elastic KV for a co-located draft (Nightjar section 6.1): lend the draft's memory to the target's KV
while nobody speculates, and take it back before the draft returns.

Expansion, when all hold for T_persist consecutive steps: speculation is off
(gamma 0 chosen) and free KV is under tau_low tokens. Then the draft is
offloaded (weights to host memory, its KV dropped) and the target's KV budget
grows by N_draft = ceil(S_draft / bytes per KV token). Contraction, when the
waiting queue is empty and free KV exceeds N_draft + tau_low: the budget
shrinks back first, then the draft reloads in the background; meanwhile steps
run without drafts. The gap between the two thresholds is the hysteresis that
keeps it from thrashing.
"""

from __future__ import annotations

import math
import time

from starjar.model.loading import LoadedModel, kv_bytes_per_token
from target_worker.scheduler import Scheduler

T_PERSIST_STEPS, TAU_LOW_TOKENS = 16, 64  # defaults for the engine and the simulated benchmark alike


class ElasticRule:
    """The trigger rule alone, in plain Python, so the simulated benchmark runs the engine's own rule."""

    def __init__(self, n_draft: int, t_persist: int = T_PERSIST_STEPS, tau_low_tokens: int = TAU_LOW_TOKENS):
        self.n_draft = n_draft
        self.t_persist = t_persist
        self.tau_low = tau_low_tokens
        self.expanded = False
        self.expansions = 0
        self.contractions = 0
        self.pressure_steps = 0

    def before_step(self, free_tokens: int, waiting: bool, draft_loaded: bool = True) -> str | None:
        """"expand", "contract" or None; the caller acts on it (budget first, then the draft).
        draft_loaded: False while a reload is still under way (nothing to lend yet)."""
        if not self.expanded:
            if self.pressure_steps >= self.t_persist and draft_loaded:
                self.expanded, self.pressure_steps = True, 0
                self.expansions += 1
                return "expand"
        elif not waiting and free_tokens > self.n_draft + self.tau_low:
            self.expanded = False
            self.contractions += 1
            return "contract"
        return None

    def after_decode(self, gamma: int, free_tokens: int, waiting: bool) -> None:
        """gamma: what the policy chose this step."""
        under = free_tokens < self.tau_low or waiting
        self.pressure_steps = self.pressure_steps + 1 if gamma == 0 and under else 0


class ElasticKV:
    """The rule acting on a target engine: the engine calls before_step and after_decode on every step."""

    def __init__(self, draft_engine, target: LoadedModel, t_persist: int = T_PERSIST_STEPS,
                 tau_low_tokens: int = TAU_LOW_TOKENS):
        """draft_engine: the co-located DraftEngine (offload, start_reload, weight_bytes); target: the model
        whose KV tokens its memory becomes."""
        self.draft = draft_engine
        self.draft.auto_reload = False  # reloads happen here, after the budget has shrunk back
        self.rule = ElasticRule(math.ceil(draft_engine.weight_bytes() / kv_bytes_per_token(target)),
                                t_persist, tau_low_tokens)
        self.base_budget: int | None = None  # the target's own KV budget, noted when it first grows
        self.hook_s = 0.0  # time spent in before_step, the critical-path cost of all this
        self.hook_calls = 0
        self.reload_dispatch_s: float | None = None  # what starting the reload cost the step that did it

    @property
    def n_draft(self) -> int:
        return self.rule.n_draft

    @property
    def expansions(self) -> int:
        return self.rule.expansions

    @property
    def contractions(self) -> int:
        return self.rule.contractions

    def before_step(self, scheduler: Scheduler, tokens_used: int) -> None:
        """Grow or shrink the scheduler's KV budget (tokens_used: what the cache holds now)."""
        t0 = time.perf_counter()
        free = scheduler.kv_budget_tokens - tokens_used
        action = self.rule.before_step(free, bool(scheduler.waiting), not self.draft.offloaded)
        if action == "expand":
            self.draft.offload()
            self.base_budget = scheduler.kv_budget_tokens
            scheduler.kv_budget_tokens = self.base_budget + self.n_draft
        elif action == "contract":
            scheduler.kv_budget_tokens = self.base_budget
            t1 = time.perf_counter()
            self.draft.start_reload()  # non-blocking; drafts resume when the weights are back
            self.reload_dispatch_s = time.perf_counter() - t1
        self.hook_s += time.perf_counter() - t0
        self.hook_calls += 1

    def after_decode(self, gamma: int, scheduler: Scheduler, tokens_used: int) -> None:
        """gamma: what the policy chose this step."""
        self.rule.after_decode(gamma, scheduler.kv_budget_tokens - tokens_used, bool(scheduler.waiting))
