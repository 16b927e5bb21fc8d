"""How much draft servers sharing one host slow each other: the simulator's host model (fabric_sim.Hosts).

k real draft server processes (`starjar serve draft`, fifo, one torch thread each, as each draft server of
the replay bench has) on this machine, each kept busy by one replay target of its own with no verification
time in between (targets in this process, as the bench's are: their wire and client work share the host
too). The mean seconds of a forward pass (as GetStats reports it) with k servers busy at once over that of
one server alone is the slowdown of k busy servers. This is a separate run (Z = 0, one target per server),
not one of the rows the simulator is checked against.
"""

from __future__ import annotations

import statistics


def pass_seconds(draft_dir: str, scripts, k: int, seconds: float, fingerprint: str) -> dict:
    """k servers busy at once, one target each, for `seconds`: the replay row (mean pass seconds in it)."""
    from benchmarks.star_fleet import sweep

    return sweep(draft_dir, "fifo", k, [k], scripts, 0.0, seconds, fingerprint)[0]


def contention(draft_dir: str, scripts, fingerprint: str, servers: int = 2, seconds: float = 5.0) -> dict:
    """The slowdown of 1 .. `servers` draft servers busy at once on this host, each against one server alone
    (measured alone before and after the others, and the mean taken: the machine's background drifts)."""
    alone = [pass_seconds(draft_dir, scripts, 1, seconds, fingerprint)]
    together = {k: pass_seconds(draft_dir, scripts, k, seconds, fingerprint) for k in range(2, servers + 1)}
    alone.append(pass_seconds(draft_dir, scripts, 1, seconds, fingerprint))
    base = statistics.fmean(r["pass_s_per_pass"] for r in alone)
    slowdown = [1.0] + [round(together[k]["pass_s_per_pass"] / base, 4) for k in range(2, servers + 1)]
    return {"pass_s_alone": [r["pass_s_per_pass"] for r in alone],
            "pass_s_together": {str(k): r["pass_s_per_pass"] for k, r in together.items()},
            "loads_together": {str(k): r["loads"] for k, r in together.items()},
            "slowdown": slowdown, "seconds": seconds, "threads": 1, "mode": "fifo", "targets_per_server": 1}
