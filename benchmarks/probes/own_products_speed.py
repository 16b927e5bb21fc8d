"""Speculation with starjar's own few-row products against the kernels they replace, and the target alone.

In each turn, for each batch size: the target alone (gamma 0), then speculation at each gamma with the draft's
int8 products torch's (STARJAR_DRAFT_INT8=torch) and starjar's own (=own), over the same greedy continuations
of starjar's own prompts. The target's float products are whatever this machine's kernel cache chose (the own
few-rows product where it won a row bucket). Turns interleave so a slow spell of the machine hits every
variant; medians are printed with ratios, acceptance and whether every output equals the target alone's.

    python -m benchmarks.probes.own_products_speed --batch-sizes 1 4 --gammas 3 5 --repeats 2 --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.meta import result_meta
from controller.colocated import colocated_engine
from starjar import workloads
from starjar.cpu import kernels
from starjar.model.default_pair import DRAFT_NAME, TARGET_NAME, models_home
from starjar.model.loading import load_model
from starjar.model.native_draft import OWN_ENV
from starjar.spec.sampling import SamplingParams


def _run(target, draft, prompts: list[list[int]], batch: int, gamma: int, max_new: int, way: str) -> dict:
    """One engine run: tokens/s, acceptance and outputs, the draft's int8 products `way`."""
    os.environ[OWN_ENV] = way
    engine = colocated_engine(target, draft if gamma else None, gamma, batch)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(len(r.output_ids) for r in reqs) / wall, "outputs": [r.output_ids for r in reqs],
            "acceptance": engine.stats.acceptance_rate if gamma else None}


def _turns(target, draft, prompts, batch: int, gammas: list[int], args) -> dict:
    """Every variant at this batch size, args.repeats interleaved turns; medians and ratios."""
    variants = [("alone", 0, "torch")] + [(f"g{g}-{way}", g, way) for g in gammas for way in ("torch", "own")]
    got: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for _ in range(args.repeats):
        for name, gamma, way in variants:
            got[name].append(_run(target, draft, prompts, batch, gamma, args.max_new, way))
    alone = statistics.median(r["tokens_per_s"] for r in got["alone"])
    row = {"batch_size": batch, "alone_tokens_per_s": round(alone, 2)}
    for name, _, _ in variants[1:]:
        tps = statistics.median(r["tokens_per_s"] for r in got[name])
        acc = [r["acceptance"] for r in got[name]]
        row[name] = {"tokens_per_s": round(tps, 2), "over_alone": round(tps / alone, 3),
                     "acceptance": round(statistics.median(acc), 3),
                     "equal_to_alone": all(r["outputs"] == got["alone"][0]["outputs"] for r in got[name])}
    for g in gammas:
        row[f"g{g}_own_over_torch"] = round(row[f"g{g}-own"]["tokens_per_s"] / row[f"g{g}-torch"]["tokens_per_s"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gammas", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompts cut to this many tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the rows and the machine to this JSON file")
    args = ap.parse_args()
    target = load_model(str(models_home() / TARGET_NAME))
    draft = load_model(str(models_home() / DRAFT_NAME))
    texts = [p.text for p in workloads.load("own", args.prompts)]
    prompts = [target.tokenizer(t)["input_ids"][: args.prompt_tokens] for t in texts]
    _run(target, draft, prompts[:2], 2, 2, 4, "own")  # warm-up: thread pool, allocator, both kernels
    _run(target, draft, prompts[:2], 2, 2, 4, "torch")
    rows = []
    for b in args.batch_sizes:
        rows.append(_turns(target, draft, prompts, b, args.gammas, args))
        print(json.dumps(rows[-1]), flush=True)
    run = {"machine": kernels.machine_label(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "prompts": args.prompts, "max_new": args.max_new, "prompt_tokens": args.prompt_tokens,
           "repeats": args.repeats}
    print(json.dumps(run))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**run, "rows": rows, "meta": result_meta(benchmark="own_products_speed")}, f, indent=1)


if __name__ == "__main__":
    main()
