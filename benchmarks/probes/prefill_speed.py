"""How long the target's prefill of one long prompt takes (the time to its first token), by prompt length.

starjar's own prompts are joined and cut to each length; each prefill runs in a fresh cache at batch 1 (the
best of --repeats), and its last logits are compared with Hugging Face's forward through starjar's cache
(STARJAR_LEAN_TARGET=0), which must give the same bits. A pass past the CPU flash kernel's key block attends in
chunks of query rows (starjar/model/native/pass_parts.h, key_chunks), so long prompts are where it shows.

    python -m benchmarks.probes.prefill_speed --lengths 512 1024 2048 --threads 1 --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.meta import result_meta
from starjar import workloads
from starjar.model.default_pair import TARGET_NAME, models_home
from starjar.model.lean_target import ENV
from starjar.model.loading import load_model


def _prefill(target, ids: list[int]) -> tuple[float, torch.Tensor]:
    cache = target.new_cache()
    slot = cache.allocate()
    t0 = time.perf_counter()
    logits = target.forward(cache, [slot], [ids], [[len(ids) - 1]])[0]
    return time.perf_counter() - t0, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target directory (default: the default pair's)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048], help="prompt tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="prefills a length, the best kept (default 3)")
    ap.add_argument("--out", required=True, help="result JSON (benchmarks/results/<machine kind>/...)")
    args = ap.parse_args()
    if args.threads < 1 or args.repeats < 1 or min(args.lengths) < 1:
        ap.error("--threads, --repeats and every length must be at least 1")
    torch.set_num_threads(args.threads)
    target = load_model(args.target or models_home() / TARGET_NAME)
    if max(args.lengths) > target.max_context:
        ap.error(f"--lengths: at most the target's context, {target.max_context} tokens")
    text = "\n\n".join(p.text for p in workloads.load("own", 64))
    pool = target.tokenizer(text)["input_ids"]
    while len(pool) < max(args.lengths):
        pool = pool + pool
    _prefill(target, pool[:64])  # warm-up: kernels chosen, libraries loaded
    rows = []
    for n in args.lengths:
        ids = pool[:n]
        times, logits = [], None
        for _ in range(args.repeats):
            took, logits = _prefill(target, ids)
            times.append(took)
        os.environ[ENV] = "0"
        try:
            _, hf = _prefill(target, ids)
        finally:
            os.environ.pop(ENV, None)
        best = min(times)
        rows.append({"tokens": n, "seconds": round(best, 4), "runs_s": [round(t, 4) for t in times],
                     "tokens_per_s": round(n / best, 1), "hf_bits": bool(torch.equal(logits, hf))})
        print(json.dumps(rows[-1]), flush=True)
    out = {"target": str(target.path), "threads": args.threads, "prefill": rows,
           "meta": result_meta(torch=torch.__version__, benchmark="prefill_speed")}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
