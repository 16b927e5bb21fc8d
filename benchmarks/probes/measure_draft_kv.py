"""A draft round's cost with its KV cache in float32 and in float16, by rows and context (starjar.model.kv_precision).

Each setting loads the default pair's draft with kv_dtype forced, fills `rows` sequences of `context` tokens,
then times gamma-4 rounds (a 2-token catch-up, then one-token steps), the two precisions in turns so that a
slow spell hits both. Prints a table and writes a JSON with the machine beside it.

    flock /tmp/starjar-cpu.lock python benchmarks/probes/measure_draft_kv.py --out F
    flock /tmp/starjar-cpu.lock scripts/emulate_isa.sh avx2 python benchmarks/probes/measure_draft_kv.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = ((1, 128), (1, 1024), (8, 128), (8, 512), (16, 512), (16, 1024))
PRECISIONS = ("float32", "float16")


def main() -> None:
    from draft_server.engine import DraftEngine
    from starjar.cpu.kernels import machine_label
    from starjar.cpu.machine import machine_info
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model
    from starjar.spec.proposer import DraftRequest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="result JSON (benchmarks/results/<machine kind>/...)")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    pair = build_default_pair()
    drafts = {kv: load_model(pair["draft"], what="draft", variant={"kv_dtype": kv}) for kv in PRECISIONS}
    vocab = drafts["float32"].vocab_size
    print(machine_label())
    rows_out = []
    for rows, context in SHAPES:
        prompts = [torch.randint(100, vocab, (context,)).tolist() for _ in range(rows)]
        engines, verified = {}, {}
        for kv, draft in drafts.items():
            eng = DraftEngine(draft)
            eng.propose([DraftRequest(i, 0, list(p), 4, 0) for i, p in enumerate(prompts)])
            engines[kv], verified[kv] = eng, [list(p) for p in prompts]
        times = {kv: [] for kv in PRECISIONS}
        for _ in range(args.rounds):
            for kv in PRECISIONS:
                reqs = []
                for i, v in enumerate(verified[kv]):
                    start, new = len(v), [v[-1] % 1000 + 17, v[-1] % 1000 + 29]
                    v += new
                    reqs.append(DraftRequest(i, start, new, 4, 0))
                t0 = time.perf_counter()
                engines[kv].propose(reqs)
                times[kv].append(time.perf_counter() - t0)
        ms = {kv: round(1000 * statistics.median(t), 2) for kv, t in times.items()}
        row = {"rows": rows, "context": context, "round_ms": ms, "float16_over_float32": round(
            ms["float16"] / ms["float32"], 3)}
        rows_out.append(row)
        print(f"{rows:3d} rows x {context:5d} tokens: float32 {ms['float32']:7.2f} ms, float16 {ms['float16']:7.2f} ms "
              f"({row['float16_over_float32']:.3f}x)", flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": machine_info(), "gamma": 4, "rounds": args.rounds, "results": rows_out}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
