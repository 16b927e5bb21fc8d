"""A target worker simulated step by step on a measured cost model, for comparing speculation policies.

Every policy runs through the same interface as in the engine (choose before a
step, observe after it). Step times come from `starjar profile` on this machine:
the measured decode step with B sequences at each gamma (step_s, interpolated
between profiled batch sizes), T(n) for prefill, and C_switch(L_max, B) when
the draft catches up on L_max tokens it has not seen (a new prompt, or steps
taken without speculation). Profiles without step_s fall back to composing a
step from T(n) and D0. Acceptance is per request, i.i.d. per draft position,
at the rate measured for its Spec-Bench category with the default pair. Runs
are labelled simulated wherever they are reported.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from dataclasses import dataclass, field

from starjar.spec.policies.nightjar import CSwitchTable
from target_worker.elastic_kv import ElasticRule


def _bracket(grid: list[int], x: float) -> tuple[int, int, float]:
    """The grid points either side of x (the outer pair beyond the ends) and x's fraction between them."""
    i = min(max(bisect_left(grid, x), 1), len(grid) - 1)
    return i - 1, i, (x - grid[i - 1]) / (grid[i] - grid[i - 1])


class CostModel:
    def __init__(self, profile: dict):
        pts = sorted((int(k), v) for k, v in profile["t_of_n"].items())
        self.ns, self.ts = [n for n, _ in pts], [t for _, t in pts]
        self.d0 = profile["d0_s"]
        self.cswitch = CSwitchTable.from_dict(profile["cswitch"])
        grid = profile.get("step_s")
        self.step_grid = (grid["batch_sizes"], grid["gammas"], grid["seconds"]) if grid else None

    def t(self, n: float) -> float:
        i, j, f = _bracket(self.ns, n)
        return max(self.ts[0] * 0.5, self.ts[i] + (self.ts[j] - self.ts[i]) * f)

    def _measured(self, batch: int, gamma: int) -> float | None:
        """The measured step, interpolated between profiled batch sizes and continued linearly past the grid's
        ends. A gamma above the grid continues the line through the two largest measured gammas (a step grows
        about linearly in gamma), so every arm is priced from the same measurements: pricing the arms the grid
        lacks from T(n) and D0 instead made a quick profile's gamma 3 cost half its gamma 2 at batch 16."""
        bs, gs, secs = self.step_grid
        i, j, f = _bracket(bs, batch)

        def at(g: int) -> float:
            return secs[i][g] + (secs[j][g] - secs[i][g]) * f

        if gamma in gs:
            return at(gs.index(gamma))
        if len(gs) >= 2 and gamma > gs[-1]:
            low, high = at(len(gs) - 2), at(len(gs) - 1)
            return high + (high - low) * (gamma - gs[-1]) / (gs[-1] - gs[-2])
        return None

    def covers(self, max_batch: int, max_gamma: int) -> bool:
        """Whether every step a simulation up to these limits takes was measured or interpolated (none
        extrapolated past the profile's grid)."""
        if not self.step_grid:
            return False
        bs, gs, _ = self.step_grid
        return max_batch <= max(bs) and all(g in gs for g in range(max_gamma + 1))

    def step(self, batch: int, gamma: int) -> float:
        measured = self._measured(batch, gamma) if self.step_grid else None
        if measured is not None:
            return measured
        if gamma == 0:
            return self.t(batch)
        return self.t(batch * (gamma + 1)) + gamma * self.d0 * self.t(batch) / self.t(1)

    def catch_up(self, behind: list[int]) -> float:
        """The draft's catch-up pass over `behind` tokens per sequence, priced as the planner prices it
        (CSwitchTable.catch_up: the longest alone, the rest at their mean; interpolated, not the grid point above)."""
        return self.cswitch.catch_up(behind)

    def prefill(self, prompt_tokens: int) -> float:
        return self.t(prompt_tokens) if prompt_tokens else 0.0


@dataclass
class SimRequest:
    arrival: float
    output_len: int
    alpha: float
    prompt_len: int
    done: int = 0
    finish: float | None = None
    behind: int = 0  # tokens the draft has not seen (the prompt, then steps without speculation)
    first: float | None = None  # when its first token came (the end of its first prefill)

    def kv_tokens(self) -> int:
        return self.prompt_len + self.done


@dataclass
class Memory:
    """An emulated device whose KV pool is short. kv_tokens: the pool with the draft's weights resident;
    draft_tokens: what those weights are worth in KV tokens (N_draft). draft_loaded=False: no draft on the
    device at all (serving without speculation), so the pool holds both. elastic: Nightjar's offload rule
    (section 6.1, the engine's own ElasticRule), lending the draft's memory to the pool while it is off."""
    kv_tokens: int
    draft_tokens: int
    draft_loaded: bool = True
    elastic: ElasticRule | None = None
    reload_s: float = 0.0


@dataclass
class SimResult:
    tokens_per_s: float
    mean_e2e_s: float
    mean_tpot_s: float = 0.0  # per request: (finish - first token) / (output tokens - 1), then the mean
    gammas: list[tuple[float, int, int]] = field(default_factory=list)  # (time, batch, gamma)
    spec_share: float = 0.0  # decode steps that speculated / all decode steps
    peak_running: int = 0
    preemptions: int = 0
    offloads: int = 0


def simulate(policy, requests: list[SimRequest], cost: CostModel, max_batch: int = 16, seed: int = 0,
             record: bool = False, memory: Memory | None = None) -> SimResult:
    rng = random.Random(seed)
    pending = sorted(requests, key=lambda r: r.arrival)
    for r in pending:
        r.done, r.finish, r.behind, r.first = 0, None, 0, None
    waiting: list[SimRequest] = []
    running: list[SimRequest] = []
    now, i, steps, spec_steps, peak, preemptions = 0.0, 0, 0, 0, 0, 0
    budget = math.inf if memory is None else memory.kv_tokens + (0 if memory.draft_loaded else memory.draft_tokens)
    elastic = memory.elastic if memory is not None else None
    offloaded, reload_done = False, 0.0
    gammas = []
    while i < len(pending) or waiting or running:
        while i < len(pending) and pending[i].arrival <= now:
            waiting.append(pending[i])
            i += 1
        if not running and not waiting:
            now = pending[i].arrival
            continue
        used = sum(r.kv_tokens() for r in running)
        if offloaded and not elastic.expanded and now >= reload_done:
            offloaded = False  # the background reload has finished
        if elastic is not None:
            action = elastic.before_step(int(budget - used), bool(waiting), draft_loaded=not offloaded)
            if action == "expand":  # the draft goes to host memory and its KV is dropped
                budget += memory.draft_tokens
                offloaded = True
                for r in running:
                    r.behind = r.kv_tokens()
            elif action == "contract":  # the budget shrinks first; the weights come back meanwhile
                budget -= memory.draft_tokens
                reload_done = now + memory.reload_s
        joined = []
        while waiting and len(running) + len(joined) < max_batch and \
                (not running and not joined or used + waiting[0].kv_tokens() + 1 <= budget):
            used += waiting[0].kv_tokens() + 1
            joined.append(waiting.pop(0))
        if joined:
            now += cost.prefill(sum(r.kv_tokens() for r in joined))
            running += joined
            for r in joined:
                r.done = r.done or 1  # prefill yields the first token (a readmitted request has its own)
                r.first = now if r.first is None else r.first
                r.behind = r.kv_tokens()  # the draft has not seen this context yet
            peak = max(peak, len(running))
            running, finished = [r for r in running if r.done < r.output_len], \
                [r for r in running if r.done >= r.output_len]
            for r in finished:
                r.finish = now
            continue
        note = getattr(policy, "note_draft_lag", None)
        if note is not None:  # as the engine tells it: what the draft must catch up on, what each may still produce
            note([r.behind for r in running], [r.output_len - r.done for r in running])
        chosen = policy.choose(len(running))
        gamma = 0 if offloaded else chosen  # an offloaded draft proposes nothing: the step runs plain
        while used + len(running) * (gamma + 1) > budget and len(running) > 1:
            victim = running.pop()  # the newest gives its KV back and is recomputed later, as in the engine
            used -= victim.kv_tokens()
            waiting.insert(0, victim)
            preemptions += 1
        if used + len(running) * (gamma + 1) > budget:
            gamma = 0
        b = len(running)
        behind = [r.behind for r in running if r.behind]
        dt = cost.step(b, gamma)
        if gamma and behind:  # the draft first catches up on what it has not seen, as the engine's does
            dt += cost.catch_up(behind)
        tokens = accepted = 0
        for r in running:
            a = 0
            if gamma:
                while a < gamma and rng.random() < r.alpha:
                    a += 1
                accepted += a
                r.behind = 0
            else:
                r.behind += 1
            n = min(a + 1, r.output_len - r.done)
            r.done += n
            tokens += n
        now += dt
        policy.observe(b, gamma, dt, tokens, accepted, gamma * b)
        if elastic is not None:
            used = sum(r.kv_tokens() for r in running)
            elastic.after_decode(chosen if not offloaded else 0, int(budget - used), bool(waiting))
        steps += 1
        spec_steps += gamma > 0
        if record:
            gammas.append((now, b, gamma))
        for r in running:
            if r.done >= r.output_len:
                r.finish = now
        running = [r for r in running if r.done < r.output_len]
    total = sum(r.output_len for r in requests)
    span = max(r.finish for r in requests) - min(r.arrival for r in requests)
    multi = [r for r in requests if r.output_len > 1]
    tpot = sum((r.finish - r.first) / (r.output_len - 1) for r in multi) / max(1, len(multi))
    return SimResult(total / span, sum(r.finish - r.arrival for r in requests) / len(requests), tpot, gammas,
                     spec_steps / max(1, steps), peak, preemptions, elastic.expansions if elastic else 0)


def alpha_from_mean_accepted(mean_accepted_len: float, gamma: int = 3) -> float:
    """The i.i.d. per-position acceptance alpha whose expected accepted drafts at `gamma` match a measurement
    (mean accepted length counts the bonus token)."""
    target = mean_accepted_len - 1
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** k for k in range(1, gamma + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def warp_trace(gaps: list[float], rates: list[float]) -> list[float]:
    """Arrival times from a trace's inter-arrival gaps (normalized to mean 1) at a local rate per request."""
    mean = sum(gaps) / len(gaps) or 1.0
    t, out = 0.0, []
    for g, r in zip(gaps, rates, strict=True):
        out.append(t)
        t += (g / mean) / r
    return out


def rise_and_fall(n: int, low: float, high: float) -> list[float]:
    """A rate per request: low for the first third, up to high and back down in the middle, low again."""
    out = []
    for k in range(n):
        x = k / max(1, n - 1)
        if x < 1 / 3 or x > 2 / 3:
            out.append(low)
        else:
            out.append(low + (high - low) * math.sin(math.pi * (x - 1 / 3) * 3))
    return out
