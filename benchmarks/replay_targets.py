"""Replay targets run together against draft servers: what `bench star` and its fleet comparison measure with."""

from __future__ import annotations

import threading
import time

from target_worker.replay import ReplayTarget

GAMMA = 4  # draft tokens per round of every replay target


def run_replay_targets(proposers, scripts, verify_s, duration_s) -> tuple[list[ReplayTarget], float]:
    """One replay target per attached proposer, run together for duration_s; the targets and the wall time.
    Each target serves one request at a time, as in StarSD, going through every script in turn from its own
    starting point: every N sees the same prompt mix, so throughput ratios compare the server(s)."""
    if not all(p.wait_attached(30) for p in proposers):
        raise RuntimeError("replay target could not attach")
    targets = [ReplayTarget(p, GAMMA, verify_s) for p in proposers]
    threads = [threading.Thread(target=t.run_in_turn, args=(scripts[k:] + scripts[:k], duration_s))
               for k, t in enumerate(targets)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return targets, time.perf_counter() - t0
