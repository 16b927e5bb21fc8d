"""What one core's memory reads and sums give up while the other core works: the budget a draft server on a core
of its own shares with its target.

The lookahead setting pins the target (one thread) to one core and the draft server (one thread) to the other, as
where the draft has a device of its own. The cores' compute is their own, but on a 2-core VM they may share
the memory channels: then every pass the draft server runs ahead slows the target's verification, which streams
its weights too. Per core, one process each, one thread, pinned: the read bandwidth (a float32 sum over 256 MiB)
and the FMA rate (a 256 x 256 product held in cache), first each core alone, then both cores at once. Linux only
(os.sched_setaffinity); run it alone:

    python -m benchmarks.probes.shared_bandwidth --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SECONDS = 3.0  # each measurement's span
WORK = r"""
import os, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[2])})
torch.set_num_threads(1)
if sys.argv[1] == "read":
    x = torch.ones(64 << 20)  # 256 MiB: past any last-level cache
    fn, unit = x.sum, x.numel() * 4 / 1e9
else:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    fn, unit = (lambda: a @ b), 2 * 256 ** 3 / 1e9
for _ in range(3):
    fn()
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()  # every process starts measuring at once
t0, n = time.perf_counter(), 0
while time.perf_counter() - t0 < float(sys.argv[3]):
    fn()
    n += 1
print(round(n * unit / (time.perf_counter() - t0), 2))
"""


def measure(kind: str, cores: list[int]) -> list[float]:
    """Per core in `cores`, its rate (GB/s read, GFLOP/s) with every listed core working at once."""
    procs = [subprocess.Popen([sys.executable, "-c", WORK, kind, str(c), str(SECONDS)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for c in cores]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {kind} process did not start")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        return [float(p.communicate(timeout=60)[0].strip()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every measurement, in turn (default 3)")
    ap.add_argument("--out", required=True, help="result JSON (benchmarks/results/<machine kind>/...)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1 (got {args.repeats})")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        ap.error(f"needs two cores to pin to (this process may run on {cores})")
    import torch

    from benchmarks.meta import result_meta

    pair = cores[-2:]
    runs: dict[str, list] = {f"{k}_{w}": [] for k in ("read", "fma") for w in ("alone", "both")}
    for rep in range(args.repeats):
        for kind in ("read", "fma"):
            runs[f"{kind}_alone"].append([measure(kind, [c])[0] for c in pair])
            runs[f"{kind}_both"].append(measure(kind, pair))
            print(f"#{rep} {kind}: alone {runs[f'{kind}_alone'][-1]}, both at once {runs[f'{kind}_both'][-1]}",
                  file=sys.stderr)

    def mean(key: str) -> float:
        values = [v for row in runs[key] for v in row]
        return round(sum(values) / len(values), 2)

    out = {"cores": pair, "seconds_each": SECONDS, "runs": runs,
           "read_gb_per_s_per_core": {"alone": mean("read_alone"), "both": mean("read_both")},
           "fma_gflop_per_s_per_core": {"alone": mean("fma_alone"), "both": mean("fma_both")},
           "read_both_over_alone": round(mean("read_both") / mean("read_alone"), 3),
           "fma_both_over_alone": round(mean("fma_both") / mean("fma_alone"), 3),
           "meta": result_meta(torch=torch.__version__, benchmark="shared_bandwidth")}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "meta")}))


if __name__ == "__main__":
    main()
