"""N_max: how many targets the draft server should admit (StarSD section 4.2).

A target's cycle is: the draft server serves its round (S), it returns to
verify and comes back (Z). Below saturation a cycle takes Z + S; once N
targets keep the server busy it takes N * S (N_full = ceil(Z/S) + 1 is where
that starts). Each cycle yields tau tokens (accepted drafts + 1), so a target
speculating among N others produces tau / max(Z + S, N * S) tokens/s. N_max is
the largest N for which that stays above what the target does alone,
x_alone; past it, a refused target simply decodes without drafts (lossless).
"""

from __future__ import annotations

import math


def n_full(z_s: float, s_s: float) -> int:
    return math.ceil(z_s / s_s) + 1 if s_s > 0 else 1


def estimate_n_full(prev: dict, cur: dict) -> tuple[float, float, int] | None:
    """(Z, S, N_full) from two draft GetStats snapshots (dicts), or None without traffic in between."""
    d_rounds = int(cur["rounds"]) - int(prev["rounds"])
    dt = float(cur["uptime_s"]) - float(prev["uptime_s"])
    if d_rounds <= 0 or dt <= 0:
        return None
    # S and T_wait are means per round (S: from a round's first pass to its reply).
    service = (float(cur["mean_service_s"]) * int(cur["rounds"])
               - float(prev["mean_service_s"]) * int(prev["rounds"])) / d_rounds
    wait = (float(cur["mean_wait_s"]) * int(cur["rounds"])
            - float(prev["mean_wait_s"]) * int(prev["rounds"])) / d_rounds
    before = {t["worker_id"]: int(t["rounds"]) for t in prev.get("targets", [])}
    returns = []
    for t in cur.get("targets", []):
        n = int(t["rounds"]) - before.get(t["worker_id"], 0)
        if n > 0:
            returns.append(dt / n - service - wait)  # one cycle = return time + wait + service
    if not returns or service <= 0:
        return None
    z = max(0.0, sum(returns) / len(returns))
    return z, service, n_full(z, service)


def per_target_tokens_per_s(n: int, z_s: float, s_s: float, tau: float) -> float:
    return tau / max(z_s + s_s, n * s_s)


def n_max(z_s: float, s_s: float, tau: float, alone_tokens_per_s: float, cap: int = 64) -> int:
    """Largest N (0..cap) whose per-target speculative throughput beats decoding alone."""
    if s_s <= 0 or tau <= 0 or alone_tokens_per_s <= 0:
        return cap
    if per_target_tokens_per_s(1, z_s, s_s, tau) <= alone_tokens_per_s:
        return 0  # speculation does not pay even for one target
    # tau / (N * S) > x_alone  <=>  N < tau / (S * x_alone)
    bound = tau / (s_s * alone_tokens_per_s)
    best = math.ceil(bound) - 1 if bound == math.ceil(bound) else math.floor(bound)
    return max(1, min(cap, max(best, n_full(z_s, s_s) - 1)))
