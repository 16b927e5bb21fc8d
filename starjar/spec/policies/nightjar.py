"""Nightjar (Algorithm 1 with Eq. 4): a contextual bandit that picks gamma per batch size.

Each batch-size bucket keeps its own clock of blocks (H = 2^(j-1) steps) split
into bins of sqrt(H) steps. At a bin's first step the bucket explores (gamma
uniform over 0..Gmax) with probability 1/b, or exploits: the gamma with the
lowest empirical latency per token, plus C_switch(L_max, B)/gamma when the
previous step ran without speculation (the draft must first catch up on
L_max tokens). The choice is locked for the whole bin, which bounds switches
by the number of bins, O(sqrt(T)). Latency per token is estimated directly
(mean of step_s/tokens), not as 1/mean goodput.

Plain Python on purpose: it runs inside the target worker's step loop.
"""

from __future__ import annotations

import json
import math
import random
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from starjar.spec.policy import PolicyHooks

# One state per batch-size octave. The paper keeps one per exact B; on a 2-core CPU a trace has a few
# thousand steps, and 16 separate learners each paid their own exploration: mean E2E at 0.6 of capacity
# was 20.8 s with exact states against 15.3 s with octaves (simulated, benchmarks/nightjar.py, on an
# earlier uniform-context profile).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PAPER_BUCKETS = tuple(range(1, 129))  # Algorithm 1 as printed: an independent state for every B
ELIMINATION_MIN_PLAYS = 8  # plays of an arm before its confidence bound can rule it out
# Tokens a lagging sequence is counted on to repay the draft's catch-up: max_tokens is often far above what a
# request produces before its end-of-sequence token.
LAG_HORIZON_TOKENS = 256
# A step slower than this many times its arm's mean so far counts as this many times the mean: such steps come
# from the process, not the arm (the KV cache growing for a 770-token newcomer made one plain step at batch 8
# take 665 ms against 55-70 ms; among ten samples it raised plain decoding's mean by 7 ms a token).
OUTLIER_FACTOR = 4.0
# Catch-ups and prefills shorter than this are not measured: a short one's time is mostly the drafting passes
# (or one pass's weight reads), which priced per token would overcharge every longer prompt.
CATCH_UP_MIN_TOKENS = 256


class CSwitchTable:
    """C_switch(L_max, B) in seconds, profiled on a grid; looked up at the nearest grid point at or
    above the query (conservative), clamped to the grid."""

    def __init__(self, lengths: list[int], batch_sizes: list[int], cost_s: list[list[float]]):
        if len(cost_s) != len(lengths) or any(len(row) != len(batch_sizes) for row in cost_s):
            raise ValueError("cost_s must be len(lengths) x len(batch_sizes)")
        self.lengths, self.batch_sizes, self.cost_s = list(lengths), list(batch_sizes), cost_s

    @staticmethod
    def _index(grid: list[int], x: float) -> int:
        i = bisect_right(grid, x - 1e-9)
        return min(i, len(grid) - 1)

    def lookup(self, l_max: float, batch_size: int) -> float:
        return max(0.0, self.cost_s[self._index(self.lengths, l_max)][self._index(self.batch_sizes, batch_size)])

    def estimate(self, length: float, batch_size: int) -> float:
        """A catch-up of `length` tokens on each of `batch_size` sequences, interpolated bilinearly (clamped to
        the grid) rather than charged at the grid point above: a 300-token prompt is not priced as 1024."""
        if len(self.lengths) < 2 or len(self.batch_sizes) < 2:
            return self.lookup(length, batch_size)
        li, lj, lf = _between(self.lengths, length)
        bi, bj, bf = _between(self.batch_sizes, batch_size)
        c = self.cost_s
        row_i = c[li][bi] + (c[li][bj] - c[li][bi]) * bf
        row_j = c[lj][bi] + (c[lj][bj] - c[lj][bi]) * bf
        return max(0.0, row_i + (row_j - row_i) * lf)

    def to_dict(self) -> dict:
        return {"lengths": self.lengths, "batch_sizes": self.batch_sizes, "cost_s": self.cost_s}

    @classmethod
    def from_dict(cls, d: dict) -> CSwitchTable:
        return cls(d["lengths"], d["batch_sizes"], d["cost_s"])

    @classmethod
    def load(cls, path: str | Path) -> CSwitchTable:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def catch_up(self, behind: list[int]) -> float:
        """One catch-up round over sequences `behind` tokens behind (all > 0): the longest priced alone, the rest
        together at their mean length. Engines pass rows of very different lengths separately, and a mean would
        price one 770-token prompt among six 10-token lags as seven 120-token rows (0.5 s measured 1.9 s)."""
        longest = max(behind)
        rest = list(behind)
        rest.remove(longest)
        cost = self.estimate(longest, 1)
        return cost + (self.estimate(sum(rest) / len(rest), len(rest)) if rest else 0.0)

    @classmethod
    def zero(cls) -> CSwitchTable:
        return cls([1], [1], [[0.0]])


def _add_timing(seen: list, tokens: int, seconds: float) -> None:
    """Add a catch-up or prefill to [tokens, seconds], if long enough to be priced per token (see
    CATCH_UP_MIN_TOKENS: a few tokens' time is mostly drafting passes or one pass's weight reads)."""
    if tokens >= CATCH_UP_MIN_TOKENS and seconds > 0:
        seen[0] += tokens
        seen[1] += seconds


def _between(grid: list[int], x: float) -> tuple[int, int, float]:
    """The grid points either side of x and x's fraction between them, clamped to [0, 1] at the ends."""
    j = min(max(bisect_right(grid, x), 1), len(grid) - 1)
    f = (x - grid[j - 1]) / (grid[j] - grid[j - 1])
    return j - 1, j, min(1.0, max(0.0, f))


@dataclass
class _Bucket:
    arms: int
    j: int = 1
    h: int = 1
    b: int = 1
    tau: int = 1
    current: int = 0
    sums: list[float] = field(default_factory=list)
    squares: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sums = [0.0] * self.arms
        self.squares = [0.0] * self.arms
        self.counts = [0] * self.arms

    def mean(self, g: int) -> float:
        """Arm g's empirical latency per token (inf while it was never played)."""
        return self.sums[g] / self.counts[g] if self.counts[g] else math.inf

    def _bounds(self, g: int, z: float) -> tuple[float, float]:
        n = self.counts[g]
        mean = self.mean(g)
        var = max(0.0, self.squares[g] / n - mean * mean)
        radius = z * math.sqrt(var / n)
        return mean - radius, mean + radius

    def worth_exploring(self, z: float, min_plays: int) -> list[int]:
        """The arms exploration may still pick: every arm played fewer than min_plays times, and every arm whose
        lower bound on latency per token is below the upper bound of the best-looking arm. An arm clearly worse
        than another is not paid for again (on a 2-core CPU a trace has a few thousand steps, and uniform
        exploration at batch 16 spent 12% of its steps on arms 20-40% slower)."""
        played = [g for g in range(self.arms) if self.counts[g] >= min_plays]
        if len(played) < 2 or math.isinf(z):
            return list(range(self.arms))
        best = min(played, key=self.mean)
        ceiling = self._bounds(best, z)[1]
        return [g for g in range(self.arms) if g not in played or self._bounds(g, z)[0] <= ceiling]

    def advance(self) -> None:
        """Lines 19-25: one round played; close the bin and the block when they are full."""
        self.tau += 1
        if self.tau > math.sqrt(self.h):
            self.b += 1
            self.tau = 1
            if self.b > math.sqrt(self.h):
                self.j += 1
                self.h = 2 ** (self.j - 1)
                self.b = 1


def speedup_bounds(step_s: dict, max_gamma: int) -> dict[int, list[float]]:
    """Per profiled batch size, each gamma's speedup over plain decoding if every draft were accepted
    (plain step x (gamma + 1) / speculative step; gamma 0 is 1). What an arm could at best save there."""
    gammas = step_s["gammas"]
    if 0 not in gammas:
        return {}
    out = {}
    for b, row in zip(step_s["batch_sizes"], step_s["seconds"], strict=False):
        plain = row[gammas.index(0)]
        out[int(b)] = [plain * (g + 1) / row[gammas.index(g)] if g in gammas else math.inf
                       for g in range(max_gamma + 1)]
    return out


def arm_limits(step_s: dict, max_gamma: int) -> dict[int, int]:
    """Gmax per profiled batch size: the largest gamma whose measured step could beat plain decoding if
    every draft were accepted. Larger arms cannot win at that batch size whatever the acceptance, so
    exploring them only costs. step_s: `starjar profile`'s {"batch_sizes", "gammas", "seconds"}."""
    out = {}
    for b, row in zip(step_s["batch_sizes"], step_s["seconds"], strict=False):
        plain = row[step_s["gammas"].index(0)] if 0 in step_s["gammas"] else None
        best = 0
        for g, sec in zip(step_s["gammas"], row, strict=False):
            if plain is not None and 0 < g <= max_gamma and sec / (g + 1) < plain:
                best = max(best, g)
        out[int(b)] = best
    return out


class NightjarPlanner(PolicyHooks):
    def __init__(self, max_gamma: int = 4, cswitch: CSwitchTable | None = None,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, seed: int | None = 0,
                 limits: dict[int, int] | None = None, name: str = "nightjar", elimination_z: float | None = 2.0,
                 bounds: dict[int, list[float]] | None = None, lag_aware: bool = True, clip_outliers: bool = True):
        """limits: Gmax per batch size (see arm_limits); a batch size between two entries takes the
        larger limit of the two (conservative: never rules out an arm that might pay). name: the registry's
        name for this configuration (nightjar, nightjar_paper). bounds: speedup_bounds of the profile, which let
        a known catch-up cost rule arms out before they are tried (see note_draft_lag); lag_aware=False ignores
        that note and clip_outliers=False keeps every step's loss as measured (Algorithm 1 as printed)."""
        self.lag_aware = lag_aware
        self.clip_outliers = clip_outliers
        self.name = name
        self.bounds = sorted((int(b), v) for b, v in (bounds or {}).items())
        self._bound_sizes = [b for b, _ in self.bounds]
        self.surcharge: float | None = None  # seconds per token a speculative step owes the catch-up; None: unknown
        self.catch_up_seen = [0, 0.0]  # draft catch-ups measured in this process: tokens, seconds
        self.prefill_seen = [0, 0.0]  # the target's prompt prefills, likewise
        self.elimination_z = math.inf if elimination_z is None else elimination_z  # inf: explore every arm
        if max_gamma < 0:
            raise ValueError("max_gamma must be >= 0")
        self.max_gamma = max_gamma
        self.limits = sorted((int(b), min(int(g), max_gamma)) for b, g in (limits or {}).items())
        self.cswitch = cswitch or CSwitchTable.zero()
        self.buckets = tuple(sorted(buckets))
        self.rng = random.Random(seed)
        self.override: int | None = None  # set by the controller (e.g. 0 while the draft server is saturated)
        self._state: dict[int, _Bucket] = {}
        self.prev_gamma = 0
        self.l_max = 0  # tokens the draft falls behind while gamma is 0 (one per step per sequence)
        self.switches = 0
        self.explorations = 0
        self.outliers = 0

    def bucket(self, batch_size: int) -> int:
        i = bisect_right(self.buckets, batch_size) - 1
        return self.buckets[max(0, i)]

    def gmax(self, batch_size: int) -> int:
        if not self.limits:
            return self.max_gamma
        sizes = [b for b, _ in self.limits]
        i = bisect_right(sizes, batch_size)
        near = self.limits[max(0, i - 1):i + 1]  # the profiled sizes at or below and above
        return max(g for _, g in near)

    def note_draft_lag(self, behind: list[int], left: list[int]) -> None:
        """Before a step, per sequence: prompt or skipped tokens the draft must catch up on before it can
        propose (0 when in step), and the tokens the sequence may still produce. The catch-up (C_switch at that
        length and count) is a cost every speculative arm pays and plain decoding does not; spread over what the
        batch can still produce, it is added to their loss. Without this note the planner falls back
        to the paper's C_switch(L_max, B) / gamma after steps without speculation."""
        if not self.lag_aware:
            return
        lagging = [b for b in behind if b > 0]
        if not lagging:
            self.surcharge = 0.0
            return
        # Spread over the whole batch's tokens to come, as the arms' losses are per token of the whole batch.
        # The profile's price, or what catch-ups measured here cost if more: a profile misses what a loaded
        # process pays (a 770-token prompt priced 0.5 s took 1.9 s), and serving often runs without one.
        # Before any catch-up is measured, the target's own prefill here stands in for it: an int8 draft's
        # prefill took about 0.67x the fp32 target's time on the 2-core Xeon, so this overprices it a little.
        tokens, seconds = self.catch_up_seen if self.catch_up_seen[0] >= CATCH_UP_MIN_TOKENS else self.prefill_seen
        measured = seconds / tokens * sum(lagging) if tokens >= CATCH_UP_MIN_TOKENS else 0.0
        cost = max(self.cswitch.catch_up(lagging), measured)
        self.surcharge = cost / max(1, sum(min(n, LAG_HORIZON_TOKENS) for n in left))

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A step's proposing, in which the draft caught up on `tokens` prompt tokens: its seconds. (The step
        itself is kept out of the arms' statistics: the catch-up is a cost of the requests, priced above.)"""
        _add_timing(self.catch_up_seen, tokens, seconds)

    def observe_target_prefill(self, tokens: int, seconds: float) -> None:
        """The target prefilled `tokens` prompt tokens in `seconds`: the catch-up's price until one is measured."""
        _add_timing(self.prefill_seen, tokens, seconds)

    def _bound(self, batch_size: int, gamma: int) -> float:
        """The best speedup gamma could give at this batch size (the larger of the profiled sizes either side)."""
        if not self.bounds:
            return math.inf
        i = bisect_right(self._bound_sizes, batch_size)
        return max(v[gamma] if gamma < len(v) else math.inf for _, v in self.bounds[max(0, i - 1):i + 1])

    def _explorable(self, st: _Bucket, batch_size: int, everything: bool = False) -> list[int]:
        """Arms worth exploring now: those the confidence bounds keep, less the speculative arms that could not
        beat plain decoding even with every draft accepted once the pending catch-up is paid (an arm is a
        cheap lesson at batch 1 with a new prompt, an expensive one when eight prompts must be drafted first)."""
        arms = list(range(st.arms)) if everything else st.worth_exploring(self.elimination_z, ELIMINATION_MIN_PLAYS)
        if not self.surcharge:
            return arms
        if not st.counts[0]:
            return [0]  # what plain decoding costs here comes first: it needs no catch-up
        plain = st.mean(0)
        keep = [g for g in arms if g == 0 or plain / self._bound(batch_size, g) + self.surcharge < plain]
        return keep or [0]

    def _catch_up_outweighs(self, st: _Bucket, gamma: int) -> bool:
        """Whether plain decoding is cheaper than `gamma` once this step's catch-up is counted (both measured)."""
        return bool(st.counts[0] and st.counts[gamma]) and st.mean(0) < st.mean(gamma) + self.surcharge

    def _exploit(self, st: _Bucket, batch_size: int) -> int:
        best, best_loss = None, math.inf
        if self.surcharge is not None:
            extra = [0.0] + [self.surcharge] * (st.arms - 1)
        else:
            switch = self.cswitch.lookup(self.l_max, batch_size) if self.prev_gamma == 0 else 0.0
            extra = [0.0] + [switch / g for g in range(1, st.arms)]
        for g in range(st.arms):
            if not st.counts[g]:
                continue
            loss = st.mean(g) + extra[g]
            if loss < best_loss:
                best, best_loss = g, loss
        return best if best is not None else self.rng.randint(0, st.arms - 1)

    def choose(self, batch_size: int) -> int:
        if self.override is not None:
            gamma = min(self.override, self.max_gamma)
        else:
            key = self.bucket(batch_size)
            st = self._state.get(key)
            if st is None:
                st = self._state[key] = _Bucket(self.gmax(key) + 1)
            if st.tau == 1:  # a bin starts: explore with probability 1/b, else exploit (Eq. 4); then lock
                if self.rng.random() < 1.0 / st.b:
                    # A block's first bin explores every arm the catch-up allows, eliminated ones too: an arm
                    # ruled out once is not ruled out for good (acceptance drifts with the workload).
                    st.current = self.rng.choice(self._explorable(st, batch_size, everything=st.b == 1))
                    self.explorations += 1
                else:
                    st.current = self._exploit(st, batch_size)
            gamma = st.current
            if gamma and self.surcharge and self._catch_up_outweighs(st, gamma):
                gamma = 0  # a prompt joined mid-bin whose catch-up this arm cannot repay: this step runs plain
            st.advance()
        if gamma != self.prev_gamma:
            self.switches += 1
        self.l_max = self.l_max + 1 if gamma == 0 else 0
        self.prev_gamma = gamma
        return gamma

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        if tokens <= 0:
            return
        st = self._state.get(self.bucket(batch_size))
        if st is None or gamma >= st.arms:
            return
        loss = step_s / tokens
        ceiling = OUTLIER_FACTOR * st.mean(gamma) if st.counts[gamma] >= 2 else math.inf
        if self.clip_outliers and loss > ceiling:
            # Clipped, not dropped: a one-off stall moves the mean little, and an arm that really became slower
            # still pulls its mean up step by step.
            self.outliers += 1
            loss = ceiling
        st.sums[gamma] += loss
        st.squares[gamma] += loss * loss
        st.counts[gamma] += 1

    def estimates(self) -> dict[int, list[float | None]]:
        """Empirical latency per token, per bucket and gamma (None = never played)."""
        return {k: [s / n if n else None for s, n in zip(st.sums, st.counts, strict=True)]
                for k, st in self._state.items()}
