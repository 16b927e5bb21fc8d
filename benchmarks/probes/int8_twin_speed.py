"""The default int8 draft's one-token step with each thread walking one run of its weight rows, and two at once.

VNNI's streamed int8 products (int8_tiles.h) walk a thread's share as one run of weight rows, or, with a row
count's twin bit set, its two halves side by side, each asked for 1 KB ahead into L2 (twin_rows). The two ways
alternate step by step after a 300-token context (the KV put back after each step), at each thread count asked
for; the outputs are the same bits either way (tests/starjar/test_own_int8.py). Run it alone; a draft server
with a core of its own runs one thread:

    taskset -c 1 python -m benchmarks.probes.int8_twin_speed --rounds 40 --threads 1 --out FILE.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import write_result

CONTEXT = 300


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="steps each way (default 40)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="torch threads, each in turn (default 1)")
    ap.add_argument("--out", required=True, help="result JSON (benchmarks/results/<machine kind>/...)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {args.rounds})")
    if min(args.threads) < 1:
        ap.error(f"--threads must each be at least 1 (got {min(args.threads)})")
    from benchmarks.meta import result_meta
    from starjar.cpu import few_rows
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model

    started = time.perf_counter()
    draft_dir = build_default_pair()["draft"]
    draft = load_model(draft_dir)
    if not few_rows.int8_available() or not torch.ops.starjar.int8_rows_vnni():
        ap.error("this CPU runs no VNNI int8 product: there is nothing to twin")
    settled = few_rows.stream_mask()
    streamed = settled >> few_rows.INT8_SHIFT & few_rows.FLOAT_STREAMED
    ways = {"one_run": settled & ~few_rows.INT8_TWINNED, "two_runs": settled | streamed << few_rows.INT8_TWIN_SHIFT}
    cache = draft.new_cache()
    slot = cache.allocate()
    held_threads = torch.get_num_threads()
    by_threads = {}
    try:
        with torch.inference_mode():
            draft.forward(cache, [slot], [[100 + i for i in range(CONTEXT)]], [[CONTEXT - 1]])
            held = cache.lengths[slot]
            for threads in args.threads:
                torch.set_num_threads(threads)
                spent: dict[str, list[float]] = {name: [] for name in ways}
                for i in range(args.rounds + 2):  # two warm-up rounds
                    for name in (list(ways) if i % 2 == 0 else list(reversed(ways))):
                        few_rows.set_stream(ways[name])
                        t0 = time.perf_counter()
                        draft.forward(cache, [slot], [[5]], [[0]])
                        took = time.perf_counter() - t0
                        cache.truncate(slot, held)
                        if i >= 2:
                            spent[name].append(took)
                ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in spent.items()}
                by_threads[str(threads)] = {"step_ms": ms, "two_over_one": round(ms["one_run"] / ms["two_runs"], 3)}
    finally:
        few_rows.set_stream(settled)
        torch.set_num_threads(held_threads)
    result = {"draft": draft_dir, "context": CONTEXT, "settled_mask": settled, "by_threads": by_threads,
              "meta": result_meta(benchmark="int8_twin_speed", wall_s=round(time.perf_counter() - started, 1))}
    write_result(args.out, result, "; ".join(
        f"{t} thread(s): a step {r['step_ms']['one_run']} ms one run, {r['step_ms']['two_runs']} ms two "
        f"({r['two_over_one']}x)" for t, r in by_threads.items()))


if __name__ == "__main__":
    main()
