"""Speculative decoding with the int8 draft's one-row passes native and scripted (starjar.model.native_draft).

The default pair, co-located, batch 1: for each gamma the engine generates the same greedy continuations with
the draft's native passes forced on and off, in turns (repeats interleaved, so that a slow spell hits both), and
the target alone runs in the same turns. Prints tokens/s, the ratios, the draft's time per one-token step both
ways, and whether every output equals the target alone's. Prefill is in the time, as in `starjar bench core`.
Given llama.cpp's llama-bench and the target as an F32 GGUF (see benchmarks.probes.llama_cpp_reference), each
turn also runs llama.cpp's token generation (tg, prefill left out), and the speeds are also given over it.

    python -m benchmarks.probes.native_draft_speed --gammas 2 3 --repeats 3 --out F.json \
        [--llama-bench build/bin/llama-bench --gguf target-f32.gguf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.meta import result_meta
from benchmarks.probes.llama_cpp_reference import llama_bench
from controller.colocated import colocated_engine
from starjar import workloads
from starjar.cpu import kernels
from starjar.model.default_pair import build_default_pair
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


def _generate(target, draft, prompts: list[list[int]], gamma: int, max_new: int) -> tuple[float, list, float]:
    """Tokens/s of one batch-1 run, its outputs and its acceptance rate (draft None: the target alone)."""
    engine = colocated_engine(target, draft if gamma else None, gamma, 1)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    wall = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in reqs) / wall, [r.output_ids for r in reqs], engine.stats.acceptance_rate


def _step_ms(draft, prompt: list[int], native: bool, n: int = 30) -> float:
    """The median time of a one-token draft step after `prompt`."""
    draft.lean.native.override = native
    cache = draft.new_cache()
    slot = cache.allocate()
    draft.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        draft.forward(cache, [slot], [[7]], [[0]])
        ts.append(time.perf_counter() - t0)
        cache.truncate(slot, len(prompt))
    draft.lean.native.override = None
    return 1000 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompts cut to this many tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench, to run in the same turns")
    ap.add_argument("--gguf", default=None, help="the target's weights as an F32 GGUF (with --llama-bench)")
    ap.add_argument("--out", default=None, help="also write the rows and the machine to this JSON file")
    args = ap.parse_args()
    if bool(args.llama_bench) != bool(args.gguf):
        raise SystemExit("--llama-bench and --gguf go together")
    pair = build_default_pair()
    target, draft = load_model(pair["target"], what="target"), load_model(pair["draft"], what="draft")
    if draft.lean is None or not draft.lean.native.packs:
        raise SystemExit("the draft has no native one-row passes here (not an int8 Llama-family draft)")
    prompts = [target.tokenizer(p.text)["input_ids"][: args.prompt_tokens]
               for p in workloads.load("own", args.prompts)]
    _generate(target, draft, prompts[:1], 2, 4)  # warm-up
    steps = {way: _step_ms(draft, prompts[0], way == "native") for way in ("scripted", "native")}
    rows = []
    for gamma in args.gammas:
        speed: dict[str, list[float]] = {"alone": [], "scripted": [], "native": []}
        outs, acceptance = {}, {}
        if args.llama_bench:
            speed["llama_cpp"] = []
        for _ in range(args.repeats):
            if args.llama_bench:
                speed["llama_cpp"].append(round(llama_bench(args.llama_bench, args.gguf, torch.get_num_threads(),
                                                            128, 3), 2))
            for way in ("alone", "scripted", "native"):
                draft.lean.native.override = way == "native"
                tps, outs[way], acceptance[way] = _generate(target, draft, prompts, 0 if way == "alone" else gamma,
                                                            args.max_new)
                draft.lean.native.override = None
                speed[way].append(round(tps, 2))
        med = {way: statistics.median(v) for way, v in speed.items()}
        row = {"gamma": gamma, "tokens_per_s": med, "runs": speed,
               "native_over_scripted": round(med["native"] / med["scripted"], 3),
               "native_over_alone": round(med["native"] / med["alone"], 3),
               "scripted_over_alone": round(med["scripted"] / med["alone"], 3),
               "acceptance": {w: round(a, 3) for w, a in acceptance.items() if w != "alone"},
               "equal": sum(outs["native"][i] == outs["alone"][i] == outs["scripted"][i] for i in range(len(prompts)))}
        if args.llama_bench:
            row.update(native_over_llama_cpp=round(med["native"] / med["llama_cpp"], 3),
                       alone_over_llama_cpp=round(med["alone"] / med["llama_cpp"], 3))
            print(f"gamma {gamma}: llama.cpp tg128 {med['llama_cpp']:.2f} tokens/s; native draft over it "
                  f"{row['native_over_llama_cpp']:.3f}x, target alone over it {row['alone_over_llama_cpp']:.3f}x")
        rows.append(row)
        print(f"gamma {gamma}: alone {med['alone']:.2f}, scripted draft {med['scripted']:.2f}, native draft "
              f"{med['native']:.2f} tokens/s; native/scripted {row['native_over_scripted']:.3f}x, native/alone "
              f"{row['native_over_alone']:.3f}x; equal {row['equal']}/{len(prompts)}", flush=True)
    print(f"draft one-token step: scripted {steps['scripted']:.2f} ms, native {steps['native']:.2f} ms "
          f"({kernels.machine_label()}, {torch.get_num_threads()} threads)")
    if args.out:
        result = {"rows": rows, "draft_step_ms": {k: round(v, 3) for k, v in steps.items()},
                  "workload": {"source": "own", "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
                               "max_new_tokens": args.max_new, "batch": 1},
                  "meta": result_meta(benchmark="native_draft_speed", repeats=args.repeats)}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
