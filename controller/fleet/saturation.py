"""Turning speculation off while the draft server is saturated.

Past N_full the draft server is busy all the time and every extra round waits
(StarSD section 4.2); once speculative steps then make fewer tokens per second
than plain ones, speculation costs more than it gives. Each target's planner
sees only its own steps; the controller sees the draft server too. Every
sample (5 s) it compares, over the last window, the draft server's load with a
threshold and the targets' tokens per second of step time in speculative
steps against plain steps. When both say so it forces gamma = 0 on every
target for `hold_s`, then hands control back to the policies and looks again:
plain steps during the hold keep the comparison current. A saturated draft
with no plain steps seen yet (a fixed gamma never makes any) gets a short
probe instead: `probe_s` of plain steps, to learn what they make.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """What the controller saw between two samples."""
    draft_load: float | None  # busy / (busy + idle) of the draft's compute loop in the window
    spec_tokens_per_s: float | None  # tokens per second of step time in steps that asked for drafts, all targets
    plain_tokens_per_s: float | None  # the same for steps that did not (the latest window that had any)


class SaturationGuard:
    def __init__(self, load_threshold: float = 0.97, hold_s: float = 30.0, probe_s: float = 6.0):
        self.load_threshold = load_threshold
        self.hold_s = hold_s
        self.probe_s = probe_s
        self.forced_since: float | None = None
        self._hold = hold_s
        self.times_forced = 0
        self.probes = 0

    @property
    def forcing(self) -> bool:
        return self.forced_since is not None

    def decide(self, now: float, w: Window) -> str | None:
        """"force" (gamma = 0 everywhere), "release" (back to the policies) or None (no change)."""
        if self.forced_since is not None:
            if now - self.forced_since >= self._hold:
                self.forced_since = None
                return "release"
            return None
        if w.draft_load is None or w.spec_tokens_per_s is None or w.draft_load < self.load_threshold:
            return None
        if w.plain_tokens_per_s is None:  # saturated, and nothing to compare with: measure plain steps
            self.forced_since, self._hold = now, self.probe_s
            self.probes += 1
            return "force"
        if w.spec_tokens_per_s < w.plain_tokens_per_s:
            self.forced_since, self._hold = now, self.hold_s
            self.times_forced += 1
            return "force"
        return None

    def cancel(self) -> None:
        """Someone else (a user's override) took control of gamma."""
        self.forced_since = None


def window_rates(prev: dict, cur: dict) -> tuple[float | None, float | None]:
    """(speculative, plain) tokens per second of step time between two sets of target stats. Steps that asked
    for drafts and got none (a missed deadline, say) count as speculative: they are what trying costs."""
    def delta(key: str) -> float:
        return sum(c.get(key, 0) - prev.get(n, {}).get(key, 0) for n, c in cur.items())

    def rate(kinds: tuple[str, ...]) -> float | None:
        dt = sum(delta(f"{k}_step_s") for k in kinds)
        dn = sum(delta(f"{k}_tokens") for k in kinds)
        return dn / dt if dt > 0 and dn > 0 else None

    return rate(("spec", "fallback")), rate(("plain",))


def draft_window_load(prev: dict, cur: dict) -> float | None:
    busy = float(cur.get("busy_s", 0.0)) - float(prev.get("busy_s", 0.0))
    idle = float(cur.get("idle_s", 0.0)) - float(prev.get("idle_s", 0.0))
    return busy / (busy + idle) if busy + idle > 0 and busy >= 0 and idle >= 0 else None
