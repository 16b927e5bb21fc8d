"""`starjar bench NAME`: look a benchmark up, run it, write its JSON."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.meta import result_meta
from starjar.errors import InvalidArgument
from starjar.model.loading import INT8_DRAFTS_LOADED

BENCHMARKS = {"core": "benchmarks.core", "tax": "benchmarks.tax", "star": "benchmarks.star",
              "cluster": "benchmarks.cluster", "draft": "benchmarks.draft", "api": "benchmarks.api",
              "nightjar": "benchmarks.nightjar", "offload": "benchmarks.offload",
              "faults": "benchmarks.faults", "tide": "benchmarks.tide", "fabric": "benchmarks.fabric",
              "adaserve": "benchmarks.adaserve", "tide-oracle": "benchmarks.tide_oracle",
              "breakdown": "benchmarks.breakdown", "lookahead": "benchmarks.lookahead"}


def run_bench(args) -> int:
    if args.name not in BENCHMARKS:
        raise InvalidArgument("NAME", f"one of {sorted(BENCHMARKS)}", args.name)
    module = importlib.import_module(BENCHMARKS[args.name])
    t0, load0 = time.time(), os.getloadavg()
    result = module.run(args)
    result["meta"] = result_meta(
        benchmark=args.name, quick=bool(args.quick), wall_s=round(time.time() - t0, 1),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(default)"),
        gomp_spincount=os.environ.get("GOMP_SPINCOUNT", "(default)"),
        # Runnable processes on the machine (1 min) before and after: others' load shows here.
        load_average_1m=[round(load0[0], 2), round(os.getloadavg()[0], 2)],
        # The variant each int8 draft loaded in this process ran with (a server process's is not seen).
        int8_drafts_in_process=dict(INT8_DRAFTS_LOADED))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0
