"""N_full, N_max and the saturation guard for every draft server of the fleet, not only the first.

A target's cycle (StarSD section 4.2) runs through the draft server it is
assigned to, so Z, S and N_full are measured per draft server (two GetStats
snapshots of that server, see admission.estimate_n_full), N_max is decided per
draft server (its own Z and S; tokens per round from the targets assigned to
it, since its draft model and batch shape them), and each draft server has its
own SaturationGuard whose verdict turns speculation off for the targets
assigned to it and no others. What does not depend on the draft server is
taken fleet-wide: how fast a target decodes alone (the target model's speed).

Pure decisions: `step` returns a Plan (N_max per draft server, gamma per
target) and the controller carries it out. A target's forced gamma follows
its assignment: one moved off a saturated server gets its policy back, one
moved onto it is held at 0 with the others there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.fleet.admission import estimate_n_full, n_max
from controller.fleet.saturation import SaturationGuard, Window, draft_window_load, window_rates

log = logging.getLogger(__name__)


@dataclass
class ServerWatch:
    """One draft server's evidence and verdicts."""
    guard: SaturationGuard | None
    estimate: tuple[float, float, int] | None = None  # (Z, S, N_full) from its recent traffic
    plain_rate: float | None = None  # its targets' plain tokens/s in the latest window that had plain steps
    window: Window | None = None  # the guard's last evidence


@dataclass
class Plan:
    n_max: dict[str, int] = field(default_factory=dict)  # draft server -> its new N_max (to set on it)
    gamma: dict[str, int | None] = field(default_factory=dict)  # target -> 0 (held off) or None (its policy)


def _mine(stats: dict, assignment: dict[str, str | None], draft: str) -> dict:
    return {t: s for t, s in stats.items() if assignment.get(t) == draft}


def fleet_alone_rate(stats: dict) -> float | None:
    """Tokens per second of plain steps over every target: a target's speed alone does not depend on a draft."""
    plain_s = sum(t.get("plain_step_s", 0.0) for t in stats.values())
    tokens = sum(t.get("plain_tokens", 0) for t in stats.values())
    return tokens / plain_s if plain_s > 0 and tokens > 0 else None


def tokens_per_round(stats: dict) -> float | None:
    steps = sum(t.get("spec_steps", 0) for t in stats.values())
    return sum(t.get("spec_tokens", 0) for t in stats.values()) / steps if steps else None


class FleetWatch:
    def __init__(self, cap: int, admission_auto: bool, make_guard: Callable[[], SaturationGuard] | None):
        """cap: the configured max_targets (N_max never goes above it); make_guard: None = no saturation guard."""
        self.cap, self.admission_auto, self._make_guard = cap, admission_auto, make_guard
        self.servers: dict[str, ServerWatch] = {}
        self.forced: set[str] = set()  # targets a guard holds at gamma 0 now
        self._targets_before: dict | None = None  # the targets' stats at the last sample

    @property
    def active(self) -> bool:
        """Anything to decide: automatic admission or a guard."""
        return self.admission_auto or self._make_guard is not None

    def server(self, name: str) -> ServerWatch:
        if name not in self.servers:
            self.servers[name] = ServerWatch(self._make_guard() if self._make_guard else None)
        return self.servers[name]

    def forgets(self, name: str) -> None:
        """A retired draft server."""
        self.servers.pop(name, None)

    def forcing(self, name: str) -> bool:
        w = self.servers.get(name)
        return w is not None and w.guard is not None and w.guard.forcing

    def cancel(self) -> None:
        """A user's gamma took over: every guard lets go (the user's set_gamma reaches the targets itself)."""
        for w in self.servers.values():
            if w.guard is not None:
                w.guard.cancel()
        self.forced = set()

    def step(self, now: float, snaps: dict[str, tuple[dict, dict]], stats: dict | None,
             assignment: dict[str, str | None], n_maxes: dict[str, int], override: int | None) -> Plan:
        """snaps: draft server -> (previous, current) GetStats snapshot; stats: the targets' stats now (None:
        not sampled); n_maxes: each draft server's N_max now. Returns what to change."""
        plan = Plan()
        before, self._targets_before = self._targets_before, stats if stats is not None else self._targets_before
        alone = fleet_alone_rate(stats) if stats else None
        for name, (prev, cur) in snaps.items():
            w = self.server(name)
            if float(cur["uptime_s"]) <= float(prev["uptime_s"]):  # restarted: it started at the configured N_max
                if name in n_maxes and n_maxes[name] != self.cap:
                    plan.n_max[name] = n_maxes[name]
                continue
            est = None if w.guard is not None and w.guard.forcing else estimate_n_full(prev, cur)
            if est is not None:
                w.estimate = est
            mine = _mine(stats, assignment, name) if stats else {}
            if est is not None and self.admission_auto and stats:
                n = self._readmit(name, est, mine, stats, alone)
                if n is not None and n != n_maxes.get(name):
                    plan.n_max[name] = n
            if w.guard is not None and before is not None and stats and override is None:
                self._guard(now, name, w, draft_window_load(prev, cur), _mine(before, assignment, name), mine)
        if override is None:
            plan.gamma = self._reconcile(assignment)
        return plan

    def _readmit(self, name: str, est: tuple, mine: dict, stats: dict, alone: float | None) -> int | None:
        """N_max for one draft server from the star model: its Z and S, the tokens per round its targets get
        (fleet-wide while none of its targets has speculated yet), the fleet's speed alone."""
        tau = tokens_per_round(mine) or tokens_per_round(stats)
        if tau is None or alone is None:
            return None  # no evidence yet for one side of the comparison
        n = max(1, n_max(est[0], est[1], tau, alone, cap=self.cap))
        log.debug("%s: N_max %d (Z %.1f ms, S %.1f ms, %.2f tokens/round, alone %.1f tokens/s)",
                  name, n, 1000 * est[0], 1000 * est[1], tau, alone)
        return n

    def _guard(self, now: float, name: str, w: ServerWatch, load: float | None, before: dict, mine: dict) -> None:
        spec_rate, plain_rate = window_rates(before, mine) if mine else (None, None)
        if plain_rate is not None:
            w.plain_rate = plain_rate
        w.window = Window(load, spec_rate, w.plain_rate)
        action = w.guard.decide(now, w.window)
        if action == "force" and w.plain_rate is None:
            log.info("%s saturated (load %.2f), no plain steps seen: %.0f s of plain steps for its targets",
                     name, load, w.guard.probe_s)
        elif action == "force":
            log.warning("%s saturated (load %.2f): its targets make %.1f tokens/s speculating, %.1f plain; "
                        "speculation off for them for %.0f s", name, load, spec_rate, w.plain_rate, w.guard.hold_s)
        elif action == "release":
            log.info("%s: saturation hold over, its targets back to their policies", name)

    def _reconcile(self, assignment: dict[str, str | None]) -> dict[str, int | None]:
        """Hold at gamma 0 exactly the targets assigned to a forcing draft server. Every held target is told
        again each step (idempotent): a lost call or a restarted target must not go on speculating."""
        want = {t for t, d in assignment.items() if d is not None and self.forcing(d)}
        changes = {t: 0 for t in want} | {t: None for t in self.forced - want}
        self.forced = want
        return changes

    def view(self) -> dict:
        """For status(): per draft server, N_full and the guard's state."""
        return {name: {"n_full_estimate": w.estimate,
                       "saturation_guard": None if w.guard is None else {
                           "forcing": w.guard.forcing, "holds": w.guard.times_forced, "probes": w.guard.probes,
                           "last_window": None if w.window is None else vars(w.window)}}
                for name, w in sorted(self.servers.items())}
