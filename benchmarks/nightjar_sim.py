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

from starjar.policies.nightjar import CSwitchTable


class CostModel:
    def __init__(self, profile: dict):
        pts = sorted((int(k), v) for k, v in profile["t_of_n"].items())
        self.ns, self.ts = [n for n, _ in pts], [t for _, t in pts]
        self.d0 = profile["d0_s"]
        self.cswitch = CSwitchTable.from_dict(profile["cswitch"])
        grid = profile.get("step_s")
        self.step_grid = (grid["batch_sizes"], grid["gammas"], grid["seconds"]) if grid else None

    def t(self, n: float) -> float:
        i = min(max(bisect_left(self.ns, n), 1), len(self.ns) - 1)
        n0, n1, t0, t1 = self.ns[i - 1], self.ns[i], self.ts[i - 1], self.ts[i]
        return max(self.ts[0] * 0.5, t0 + (t1 - t0) * (n - n0) / (n1 - n0))

    def _measured(self, batch: int, gamma: int) -> float | None:
        bs, gs, secs = self.step_grid
        if gamma not in gs:
            return None
        col = [row[gs.index(gamma)] for row in secs]
        i = min(max(bisect_left(bs, batch), 1), len(bs) - 1)
        b0, b1 = bs[i - 1], bs[i]
        return col[i - 1] + (col[i] - col[i - 1]) * (batch - b0) / (b1 - b0)

    def step(self, batch: int, gamma: int) -> float:
        measured = self._measured(batch, gamma) if self.step_grid else None
        if measured is not None:
            cost = measured
        elif gamma == 0:
            return self.t(batch)
        else:
            cost = self.t(batch * (gamma + 1)) + gamma * self.d0 * self.t(batch) / self.t(1)
        return cost

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


@dataclass
class SimResult:
    tokens_per_s: float
    mean_e2e_s: float
    gammas: list[tuple[float, int, int]] = field(default_factory=list)  # (time, batch, gamma)


def simulate(policy, requests: list[SimRequest], cost: CostModel, max_batch: int = 16, seed: int = 0,
             record: bool = False) -> SimResult:
    rng = random.Random(seed)
    pending = sorted(requests, key=lambda r: r.arrival)
    for r in pending:
        r.done, r.finish, r.behind = 0, None, 0
    waiting: list[SimRequest] = []
    running: list[SimRequest] = []
    now, i = 0.0, 0
    gammas = []
    while i < len(pending) or waiting or running:
        while i < len(pending) and pending[i].arrival <= now:
            waiting.append(pending[i])
            i += 1
        if not running and not waiting:
            now = pending[i].arrival
            continue
        joined = []
        while waiting and len(running) + len(joined) < max_batch:
            joined.append(waiting.pop(0))
        if joined:
            now += cost.prefill(sum(r.prompt_len for r in joined))
            running += joined
            for r in joined:
                r.done = 1  # prefill yields the first token
                r.behind = r.prompt_len + 1  # the draft has not seen the prompt yet
            running, finished = [r for r in running if r.done < r.output_len], \
                [r for r in running if r.done >= r.output_len]
            for r in finished:
                r.finish = now
            continue
        b = len(running)
        gamma = policy.choose(b)
        behind = [r.behind for r in running if r.behind]
        dt = cost.step(b, gamma)
        if gamma and behind:  # the draft first catches up on what it has not seen, as the engine's does
            dt += cost.cswitch.lookup(max(behind), len(behind))
        tokens = accepted = 0
        for r in running:
            if gamma:
                a = 0
                while a < gamma and rng.random() < r.alpha:
                    a += 1
                accepted += a
                r.behind = 0
            else:
                a = 0
                r.behind += 1
            n = min(a + 1, r.output_len - r.done)
            r.done += n
            tokens += n
        now += dt
        policy.observe(b, gamma, dt, tokens, accepted, gamma * b)
        if record:
            gammas.append((now, b, gamma))
        for r in running:
            if r.done >= r.output_len:
                r.finish = now
        running = [r for r in running if r.done < r.output_len]
    total = sum(r.output_len for r in requests)
    span = max(r.finish for r in requests) - min(r.arrival for r in requests)
    return SimResult(total / span, sum(r.finish - r.arrival for r in requests) / len(requests), gammas)


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
    for g, r in zip(gaps, rates):
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
