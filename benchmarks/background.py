"""What the rest of the machine does while a measurement runs: CPU time and wake-ups of every other process.

On a 2-core machine a target computing on 2 OpenMP threads pays about twice
any other process's CPU share: when one of its threads is taken off its core
for a moment, the other waits for it at the op's end. A Ray cluster at rest
(GCS, raylet, agents, log monitor, and every actor's 10 ms signal-check timer)
is such a neighbour. Linux only (/proc); elsewhere the sample is None.
"""

from __future__ import annotations

import os
import time


def _threads() -> dict[tuple[str, str], tuple[int, int]]:
    """(pid, tid) -> (CPU ticks, context switches) for every thread of every process now running."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
                out[(pid, tid)] = (int(fields[11]) + int(fields[12]), switches)
        except OSError:  # the process or thread ended while being read
            continue
    return out


def sample(seconds: float, exclude: set[int] = frozenset()) -> dict | None:
    """The CPU share (percent of one core) and wake-ups per second of all processes but `exclude` and this one
    over `seconds`."""
    if not os.path.isdir("/proc/self/task"):
        return None
    skip = {str(p) for p in exclude} | {str(os.getpid())}
    before = _threads()
    t0 = time.perf_counter()
    time.sleep(seconds)
    after = _threads()
    wall = time.perf_counter() - t0
    ticks = switches = 0
    for key, (cpu, sw) in after.items():
        if key[0] in skip or key not in before:
            continue
        ticks += cpu - before[key][0]
        switches += sw - before[key][1]
    return {"seconds": round(wall, 1), "cpu_pct_of_one_core": round(100 * ticks / os.sysconf("SC_CLK_TCK") / wall, 1),
            "wakeups_per_s": round(switches / wall)}
