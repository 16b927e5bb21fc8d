"""When to collect training data: TIDE's Algorithm 1 (adaptive training control), as plain Python.

Two exponential moving averages of the draft's acceptance, one short-horizon and
one long: when the short one falls below the long one by more than a margin,
the traffic has drifted away from what the draft knows, and collection turns
on. Each finished training cycle reports the held-out acceptance of the
serving draft and of the adapted one: adapted weights that beat the serving
ones are deployed (and collection goes on); adapted weights that do not beat
them mean training stopped helping, and collection turns off until the next
drift. No torch, no threads: the draft server's compute thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from starjar.errors import InvalidArgument


@dataclass(frozen=True)
class CollectConfig:
    short_decay: float = 0.9  # lambda_short, per observed round: about the last 10 rounds
    long_decay: float = 0.995  # lambda_long: about the last 200 rounds
    margin: float = 0.03  # epsilon: short < long - margin turns collection on
    init_rounds: int = 20  # N_init: both averages start at the mean of the first rounds
    min_gain: float = 0.0  # adapted held-out acceptance must beat serving by more than this to be deployed
    start_collecting: bool = False  # TIDE starts off; on: collect from the first round (a cold start)

    def __post_init__(self) -> None:
        for name in ("short_decay", "long_decay"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise InvalidArgument(name, "must be in [0, 1)", v)
        if not self.short_decay < self.long_decay:
            raise InvalidArgument("short_decay", f"must be < long_decay ({self.long_decay})", self.short_decay)
        if not 0.0 <= self.margin < 1.0:
            raise InvalidArgument("margin", "must be in [0, 1)", self.margin)
        if not 1 <= self.init_rounds <= 100_000:
            raise InvalidArgument("init_rounds", "must be in [1, 100000]", self.init_rounds)
        if not 0.0 <= self.min_gain < 1.0:
            raise InvalidArgument("min_gain", "must be in [0, 1)", self.min_gain)


class CollectionControl:
    """Acceptance averages and the collection switch. Acceptance is accepted / proposed draft tokens."""

    def __init__(self, cfg: CollectConfig | None = None):
        self.cfg = cfg or CollectConfig()
        self.collecting = self.cfg.start_collecting
        self.short: float | None = None  # None until init_rounds rounds were seen
        self.long: float | None = None
        self._init: list[float] = []
        self.switched_on = 0  # times collection turned on (drifts detected)
        self.switched_off = 0  # times it turned off (training stopped improving)
        self.deployed = 0  # training cycles whose weights were deployed
        self.rejected = 0  # training cycles whose weights were not

    def observe(self, accepted: int, proposed: int) -> None:
        """One round of one sequence: `accepted` of its `proposed` drafts were verified. Rounds that
        proposed nothing say nothing about the draft and are ignored."""
        if proposed <= 0:
            return
        alpha = min(1.0, max(0.0, accepted / proposed))
        c = self.cfg
        if self.short is None or self.long is None:
            self._init.append(alpha)
            if len(self._init) >= c.init_rounds:
                self.short = self.long = sum(self._init) / len(self._init)
                self._init = []
            return
        self.short = c.short_decay * self.short + (1 - c.short_decay) * alpha
        self.long = c.long_decay * self.long + (1 - c.long_decay) * alpha
        if not self.collecting and self.short < self.long - c.margin:
            self.collecting = True
            self.switched_on += 1

    def training_result(self, serving: float, adapted: float) -> bool:
        """A training cycle ended with these held-out acceptances. True: deploy the adapted weights."""
        if adapted > serving + self.cfg.min_gain:
            self.deployed += 1
            return True
        self.rejected += 1
        if self.collecting:
            self.collecting = False
            self.switched_off += 1
        return False
