"""BanditSpec-style UCB1 over gamma, without batch context.

Reward is the step's goodput (tokens/s) scaled by the best goodput seen so
far, so the exploration bonus stays meaningful on any machine.
"""

from __future__ import annotations

import math

from starjar.spec.policy import PolicyHooks


class BanditSpecUCB(PolicyHooks):
    name = "banditspec"

    def __init__(self, max_gamma: int = 4, c: float = 0.5):
        self.max_gamma, self.c = max_gamma, c
        self.sums = [0.0] * (max_gamma + 1)
        self.counts = [0] * (max_gamma + 1)
        self.best_goodput = 0.0
        self.t = 0

    def choose(self, batch_size: int) -> int:
        for g, n in enumerate(self.counts):
            if n == 0:
                return g
        scale = self.best_goodput or 1.0
        log_t = math.log(max(1, self.t))
        return max(range(self.max_gamma + 1),
                   key=lambda g: self.sums[g] / self.counts[g] / scale + self.c * math.sqrt(2 * log_t / self.counts[g]))

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        if step_s <= 0 or gamma > self.max_gamma:
            return
        goodput = tokens / step_s
        self.best_goodput = max(self.best_goodput, goodput)
        self.sums[gamma] += goodput
        self.counts[gamma] += 1
        self.t += 1
