"""TIDE's adaptive drafter (section 4.1, Eq. 5): speculation on or off by predicted speedup.

  speedup(b) = (1 - a^(g+1)) / ((1 - a) * (c(b) * g + beta(b))),
  c(b) = D0 / T(b),  beta(b) = T(b * (g + 1)) / T(b)

T(n) (target latency for n tokens in one pass) and D0 (a draft step) are
profiled; a is the acceptance rate from history. Speculates with its fixed
gamma when the predicted speedup exceeds 1, otherwise not. While off it keeps
no fresh acceptance data, so the estimate stays where it was (as in TIDE).
"""

from __future__ import annotations

from bisect import bisect_left

from starjar.spec.policy import PolicyHooks


class TidePolicy(PolicyHooks):
    name = "tide"

    def __init__(self, t_of_n: dict[int, float], d0_s: float, gamma: int = 2, ema: float = 0.05,
                 alpha0: float = 0.6):
        self.ns = sorted(t_of_n)
        self.ts = [t_of_n[n] for n in self.ns]
        self.d0, self.gamma, self.ema, self.alpha = d0_s, gamma, ema, alpha0

    def t(self, n: float) -> float:
        """T(n), linearly interpolated (extrapolated past the last two grid points)."""
        i = min(max(bisect_left(self.ns, n), 1), len(self.ns) - 1)
        n0, n1, t0, t1 = self.ns[i - 1], self.ns[i], self.ts[i - 1], self.ts[i]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0) if n1 != n0 else t0

    def speedup(self, batch_size: int) -> float:
        g, a = self.gamma, min(self.alpha, 0.999)
        tb = self.t(batch_size)
        return (1 - a ** (g + 1)) / ((1 - a) * (self.d0 / tb * g + self.t(batch_size * (g + 1)) / tb))

    def choose(self, batch_size: int) -> int:
        return self.gamma if self.speedup(batch_size) > 1.0 else 0

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        if drafted:
            self.alpha += self.ema * (accepted / drafted - self.alpha)
