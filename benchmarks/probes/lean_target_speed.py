"""The target decoding alone with Hugging Face's forward and with the lean one (starjar.model.lean_target).

For each batch size, the target engine without a draft (gamma 0) generates the same greedy continuations of
starjar's own prompts under STARJAR_LEAN_TARGET=0 and =1, in turns (repeats interleaved, so that a slow spell
hits both), and prints tokens/s per forward, their ratio, and whether the outputs were the same token for token.
Prefill is in the time, as in `starjar bench core`.

    python -m benchmarks.probes.lean_target_speed --batch-sizes 1 4 8 16 --max-new 32 --repeats 3 --out F.json
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
from starjar.model.default_pair import TARGET_NAME, models_home
from starjar.model.lean_target import ENV
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


def _generate(target, prompts: list[list[int]], batch: int, max_new: int, lean: str) -> tuple[float, list]:
    """Tokens/s of one engine run over `prompts` at `batch`, with the lean forward forced on or off."""
    os.environ[ENV] = lean
    engine = colocated_engine(target, None, 0, batch)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    wall = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in reqs) / wall, [r.output_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(models_home() / TARGET_NAME))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompts cut to this many tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the rows and the machine to this JSON file")
    args = ap.parse_args()
    os.environ[ENV] = "1"  # forced from the start: the load need not measure the choice
    target = load_model(args.target)
    texts = [p.text for p in workloads.load("own", max(args.batch_sizes))]
    prompts = [target.tokenizer(t)["input_ids"][: args.prompt_tokens] for t in texts]
    _generate(target, prompts[:2], 2, 4, "1")  # warm-up: thread pool, allocator, scripted graphs
    _generate(target, prompts[:2], 2, 4, "0")
    rows = []
    for b in args.batch_sizes:
        speed: dict[str, list[float]] = {"0": [], "1": []}
        outs = {}
        for _ in range(args.repeats):
            for lean in ("0", "1"):
                tps, outs[lean] = _generate(target, prompts[:b], b, args.max_new, lean)
                speed[lean].append(tps)
        hf, lean = statistics.median(speed["0"]), statistics.median(speed["1"])
        rows.append({"batch_size": b, "hf_tokens_per_s": round(hf, 2), "lean_tokens_per_s": round(lean, 2),
                     "ratio": round(lean / hf, 3), "same_output": outs["0"] == outs["1"]})
        print(json.dumps(rows[-1]), flush=True)
    run = {"machine": kernels.machine_label(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "target": args.target, "max_new": args.max_new, "prompt_tokens": args.prompt_tokens,
           "repeats": args.repeats}
    print(json.dumps(run))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**run, "rows": rows, "meta": result_meta(benchmark="lean_target_speed")}, f, indent=1)


if __name__ == "__main__":
    main()
