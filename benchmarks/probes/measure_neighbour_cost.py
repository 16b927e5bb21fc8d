"""What a little CPU use by other processes costs a target that computes on every core.

A `starjar serve target` process (the default pair's target, no drafts, batch 1, --threads 2) decodes the
demo's 16 Spec-Bench prompts one at a time (chat, 48 new tokens), alone and beside synthetic neighbours:
processes that wake on a timer and spin for a while, like a Ray cluster's daemons and actors at rest
(`starjar bench breakdown`, deployment beside-ray). Prints each run's wall time against the first run alone
and the neighbours' measured CPU share (benchmarks/background.py); outputs must stay identical. Run it alone,
under the CPU lock:

    flock /tmp/starjar-cpu.lock python benchmarks/probes/measure_neighbour_cost.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# name, neighbour processes, wake-up period (ms), spin per wake-up (µs); none = the target alone
SETTINGS = [("alone", 0, 0, 0), ("14 x 100 Hz, 30 us spin", 14, 10, 30), ("1 x 40 Hz, 1 ms spin", 1, 25, 1000),
            ("14 x 100 Hz, no spin", 14, 10, 0), ("alone again", 0, 0, 0)]
NEIGHBOUR = """
import time, sys
period, spin = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e6
while True:
    time.sleep(period)
    t = time.perf_counter()
    while time.perf_counter() - t < spin:
        pass
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the rows and the machine as JSON here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from benchmarks import background, breakdown
    from benchmarks.launch import ServerProcess
    from starjar import workloads
    from starjar.cpu.kernels import machine_label
    from starjar.cpu.machine import machine_info
    from starjar.model.default_pair import build_default_pair
    from starjar.model.text import encode_prompt

    pair = build_default_pair()
    tok = AutoTokenizer.from_pretrained(pair["target"])
    prompts = [encode_prompt(tok, p, chat=True) for p in workloads.texts(workloads.load("own", 16))]
    target = ServerProcess("target", "--model", pair["target"], "--port", "0", "--gamma", "0", "--batch-size", "1",
                           "--metrics-port", "0", threads=2)
    rows, reference = [], None
    try:
        for name, count, period_ms, spin_us in SETTINGS:
            neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(period_ms), str(spin_us)])
                          for _ in range(count)]
            try:
                time.sleep(0.5)
                share = background.sample(3.0, exclude={target.proc.pid})  # the neighbours and the rest, target idle
                row = breakdown.measure_deployment("processes", 0, target.address, target.ready["metrics"], prompts)
            finally:
                for p in neighbours:
                    p.kill()
                    p.wait()
            reference = reference or row["outputs"]
            rows.append({"setting": name, "neighbours": count, "period_ms": period_ms, "spin_us": spin_us,
                         "others_at_rest": share, "wall_s": row["wall_s"],
                         "verify_ms_per_step": row["ms_per_decode_step"]["verify"],
                         "identical": sum(a == b for a, b in zip(row["outputs"], reference, strict=True))})
    finally:
        target.terminate()
    base = rows[0]["wall_s"]
    print(f"\n{machine_label()}: serve target, 16 prompts one at a time, no drafts", file=sys.stderr)
    for r in rows:
        cpu = (r["others_at_rest"] or {}).get("cpu_pct_of_one_core", float("nan"))
        print(f"{r['setting']:28s} others {cpu:5.1f}% of a core  wall {r['wall_s']:6.1f} s "
              f"({r['wall_s'] / base:5.3f}x)  verify {r['verify_ms_per_step']:5.1f} ms  same {r['identical']}/16",
              file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "meta": {"script": "benchmarks/probes/measure_neighbour_cost.py", **machine_info(),
                                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}},
                      f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
