"""How long OpenMP's idle threads spin: short, for processes that take turns on the same cores.

torch's CPU ops run on GNU OpenMP threads that, after each parallel region, spin before they sleep (300,000
iterations by default). A target worker and its draft server take turns: while one computes, the other waits
for it, and a waiter's spinning threads take the cores the worker needs. OMP_WAIT_POLICY=PASSIVE (no spin)
cures that but makes every op wake its threads through the kernel, which a draft pass of ~800 small ops pays
for. Measured with `starjar bench tax --quick` (AMD EPYC, AVX2, 2 cores, gamma 2, draft server at 2 threads),
co-located / remote tokens/s: default spin 22.6 / 19.8, PASSIVE 19.7 / 18.9, GOMP_SPINCOUNT=20000 22.5 / 21.1,
10000 22.3 / 21.1, 2000 22.0 / 20.9. A short spin keeps op-to-op hand-offs fast and lets a waiting process's
threads sleep soon. GOMP_SPINCOUNT is GNU OpenMP's (the libgomp that torch's Linux wheels ship); a torch built with
another OpenMP ignores it and spins by its own default.

The count is in iterations, and an iteration's `pause` costs what the CPU makes it: 9.5 ns on the 2-core Intel
Xeon (AVX512 capability, AMX), so 10000 spun about 0.1 ms there, shorter than some gaps inside a draft round.
There, 100000 (about 1 ms) measured faster: a gamma-5 draft round after a 40 ms idle gap 47.6 against 52.1 ms
in-process; target + `serve draft` processes on the demo's 16 prompts 20.0-21.5 against 21.0-22.5 s (three
pairs); `starjar demo` 1.25x and 1.27x against 1.18x and 1.20x. Intel CPUs take 100000, others keep 10000 (the
EPYC measurements above); GOMP_SPINCOUNT or OMP_WAIT_POLICY set by the user wins.
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"
SPIN_COUNT_INTEL = "100000"  # a longer `pause` per iteration there (see above)


def share_cores() -> None:
    """Set a short spin for this process and the processes it starts, unless the user chose a policy. Must run
    before torch is imported (OpenMP reads it when it loads)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = spin_count()


def spin_count(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as f:
            intel = any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        intel = False
    return SPIN_COUNT_INTEL if intel else SPIN_COUNT
