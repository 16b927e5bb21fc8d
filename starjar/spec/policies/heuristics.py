"""Three rule-of-thumb schedules used by serving systems, as baselines.

- vllm_table: a static table from batch size to gamma (vLLM's speculative config
  with disable-by-batch-size: speculate below a batch size, not above).
- sglang_ema: an EMA of acceptance per batch-size range; gamma grows while
  acceptance is high and shrinks (to 0) while it is low, with a periodic probe.
- hf_heuristic: Hugging Face assisted generation's schedule: +2 after a step
  where every draft was accepted, -1 otherwise (never below 1).
"""

from __future__ import annotations

from bisect import bisect_right

from starjar.spec.policy import PolicyHooks


class VllmTable(PolicyHooks):
    name = "vllm_table"

    def __init__(self, table: dict[int, int] | None = None, max_gamma: int = 4):
        # batch size lower bound -> gamma; default: speculate fully when alone, less as the batch grows.
        self.table = sorted((table or {1: max_gamma, 2: max(1, max_gamma // 2), 4: 1, 8: 0}).items())
        self.bounds = [b for b, _ in self.table]

    def choose(self, batch_size: int) -> int:
        return self.table[max(0, bisect_right(self.bounds, batch_size) - 1)][1]

    def observe(self, *args, **kw) -> None:
        pass


class SglangEma(PolicyHooks):
    name = "sglang_ema"

    def __init__(self, max_gamma: int = 4, ema: float = 0.1, high: float = 0.7, low: float = 0.35,
                 probe_every: int = 200, ranges: tuple[int, ...] = (1, 4, 16, 64)):
        self.max_gamma, self.ema, self.high, self.low, self.probe_every = max_gamma, ema, high, low, probe_every
        self.ranges = ranges
        self.state = {r: [0.6, 1, 0] for r in ranges}  # range -> [acceptance EMA, gamma, steps since gamma>0]

    def _range(self, batch_size: int) -> int:
        return self.ranges[max(0, bisect_right(self.ranges, batch_size) - 1)]

    def choose(self, batch_size: int) -> int:
        st = self.state[self._range(batch_size)]
        if st[1] == 0:
            st[2] += 1
            if st[2] >= self.probe_every:  # look again: acceptance may have changed
                st[1], st[2] = 1, 0
        return st[1]

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        if not drafted:
            return
        st = self.state[self._range(batch_size)]
        st[0] += self.ema * (accepted / drafted - st[0])
        if st[0] > self.high:
            st[1] = min(self.max_gamma, st[1] + 1)
        elif st[0] < self.low:
            st[1] = max(0, st[1] - 1)


class HfHeuristic(PolicyHooks):
    name = "hf_heuristic"

    def __init__(self, max_gamma: int = 4, start: int | None = None):
        self.max_gamma = max_gamma
        self.gamma = start if start is not None else max_gamma

    def choose(self, batch_size: int) -> int:
        return self.gamma

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        if not drafted:
            return
        self.gamma = min(self.max_gamma, self.gamma + 2) if accepted == drafted else max(1, self.gamma - 1)
