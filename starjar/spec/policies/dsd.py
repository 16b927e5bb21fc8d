"""DSD (Liu et al. 2024, "Optimizing speculative decoding for serving LLMs using goodput"), compact.

Acceptance rate alpha from history (EMA over rounds); a linear latency model
fitted online, step_s = a + b * B * (gamma + 1) + c * gamma (target tokens
verified, draft steps); pick the gamma that maximizes predicted goodput
B * (1 - alpha^(gamma+1)) / (1 - alpha) / step_s. Until the model has seen
three distinct configurations it plays `warmup_gamma`.
"""

from __future__ import annotations

from starjar.spec.policies.linear_fit import OnlineLeastSquares
from starjar.spec.policy import PolicyHooks


class DSDPolicy(PolicyHooks):
    name = "dsd"

    def __init__(self, max_gamma: int = 4, warmup_gamma: int = 1, ema: float = 0.05):
        self.max_gamma, self.warmup_gamma, self.ema = max_gamma, warmup_gamma, ema
        self.alpha = 0.5
        self.fit = OnlineLeastSquares(3)
        self._configs: set[tuple[int, int]] = set()

    def choose(self, batch_size: int) -> int:
        coef = self.fit.solve() if len(self._configs) >= 3 else None
        if coef is None:
            return self.warmup_gamma
        a, b, c = coef
        alpha = min(self.alpha, 0.999)
        best, best_goodput = 0, -1.0
        for g in range(self.max_gamma + 1):
            step = max(1e-6, a + b * batch_size * (g + 1) + c * g)
            tokens = batch_size * (1 - alpha ** (g + 1)) / (1 - alpha)
            if tokens / step > best_goodput:
                best, best_goodput = g, tokens / step
        return best

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        self.fit.add([1.0, batch_size * (gamma + 1), gamma], step_s)
        self._configs.add((batch_size, gamma))
        if drafted:
            self.alpha += self.ema * (accepted / drafted - self.alpha)
