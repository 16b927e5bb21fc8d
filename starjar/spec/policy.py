"""Speculation policies: how many draft tokens (gamma) to ask for at each step.

Plain Python (no torch, no gRPC) so the target worker runs the decision in its
own step loop. A policy chooses with `choose(batch_size)` before a step and
learns from `observe(...)` after it, what the step cost and produced. The
engine also tells it, through hooks every policy has (PolicyHooks: no-ops
unless a policy uses them), `note_draft_lag(behind, left)` just before
`choose`: per sequence, the tokens the draft must catch up on and those it may
still produce; `observe_catch_up(tokens, seconds)` after a step whose proposing
caught the draft up on new prompts; and `observe_target_prefill(tokens,
seconds)` after the target prefilled prompts: what each took.
"""

from __future__ import annotations

from typing import Protocol


class SpeculationPolicy(Protocol):
    name: str

    def choose(self, batch_size: int) -> int: ...

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None: ...

    def note_draft_lag(self, behind: list[int], left: list[int]) -> None: ...

    def observe_catch_up(self, tokens: int, seconds: float) -> None: ...

    def observe_target_prefill(self, tokens: int, seconds: float) -> None: ...


class PolicyHooks:
    """The engine's notes a policy may ignore: each a no-op here, overridden where a policy uses it."""

    def note_draft_lag(self, behind: list[int], left: list[int]) -> None:
        pass

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        pass

    def observe_target_prefill(self, tokens: int, seconds: float) -> None:
        pass


class FixedGamma(PolicyHooks):
    """Always the same gamma (0 = never speculate)."""

    def __init__(self, gamma: int):
        if gamma < 0:
            raise ValueError("gamma must be >= 0")
        self.gamma = gamma
        self.name = "none" if gamma == 0 else f"fixed_{gamma}"

    def choose(self, batch_size: int) -> int:
        return self.gamma

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        pass


class Overridable:
    """Wraps a policy so an operator (the controller) can force a gamma, e.g. 0 while the draft server is
    saturated or to measure a run without speculation; `override = None` hands control back."""

    def __init__(self, inner: SpeculationPolicy):
        self.inner = inner
        self.override: int | None = None

    @property
    def name(self) -> str:
        return self.inner.name

    def choose(self, batch_size: int) -> int:
        return self.override if self.override is not None else self.inner.choose(batch_size)

    def observe(self, batch_size: int, gamma: int, step_s: float, tokens: int, accepted: int,
                drafted: int) -> None:
        self.inner.observe(batch_size, gamma, step_s, tokens, accepted, drafted)

    def note_draft_lag(self, behind: list[int], left: list[int]) -> None:
        self.inner.note_draft_lag(behind, left)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        self.inner.observe_catch_up(tokens, seconds)

    def observe_target_prefill(self, tokens: int, seconds: float) -> None:
        self.inner.observe_target_prefill(tokens, seconds)
