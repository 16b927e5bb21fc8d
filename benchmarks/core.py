"""`starjar bench core`: the co-located engine on a real pair.

Measures, on starjar's own prompts (no chat template; --dataset for another set), in one run:
  - HF generate() greedy per prompt: the reference outputs and the HF target-alone speed;
  - starjar at batch sizes {1, 4, 8, 16} x gamma {0..5}: tokens/s, acceptance rate,
    mean accepted length, and how many outputs equal the reference token for token;
  - HF assisted generation at batch 1 (constant and heuristic schedules) as the peer;
  - the draft's catch-up prefill (Nightjar's switching cost) by catch-up length and batch.
Every run's tokens/s counts its prefill; its decode tokens/s leaves the target's prefill out (the draft's work,
prefill included, stays in), as llama.cpp's tg leaves prefill out. Given --llama-bench and --gguf, llama.cpp's
tg128 on the same weights and threads runs before and after starjar's runs, and the best speculative decode
at batch 1 is given over it.
All speeds are ratios within this run; absolute numbers hold only for this machine.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import pair_dirs, prompt_texts
from benchmarks.fixtures.reference import hf_greedy
from benchmarks.memory_floor import memory_floor
from controller.colocated import colocated_engine, load_pair
from draft_server.engine import DraftEngine
from starjar.spec.proposer import DraftRequest
from starjar.spec.sampling import SamplingParams


def run(args) -> dict:
    quick = args.quick
    n_prompts, max_new = (8, 32) if quick else (24, 64)
    batch_sizes = [1, 4, 8] if quick else [1, 4, 8, 16]
    gammas = [0, 1, 2, 3] if quick else [0, 1, 2, 3, 4, 5]
    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_pair(target_dir, draft_dir)
    prompts = [target.tokenizer(p.text)["input_ids"] for p in prompt_texts(args, n_prompts)]
    params = SamplingParams(max_tokens=max_new)

    # Warm-up: first passes pay allocator and thread-pool start-up.
    colocated_engine(target, draft, 2, 4).generate(prompts[:4], SamplingParams(max_tokens=8))

    ref, hf_s = [], 0.0
    for p in tqdm(prompts, desc="HF generate (reference)", file=sys.stderr):
        t0 = time.perf_counter()
        ref.append(hf_greedy(target, p, max_new))
        hf_s += time.perf_counter() - t0
    hf_tokens = sum(len(r) for r in ref)

    llama = _llama_cpp(args)
    runs = []
    bar = tqdm(total=len(batch_sizes) * len(gammas), desc="starjar runs", file=sys.stderr)
    for bs in batch_sizes:
        for g in gammas:
            engine = colocated_engine(target, draft if g else None, g, bs)
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            tokens = sum(len(r.output_ids) for r in reqs)
            s = engine.stats
            runs.append({"batch_size": bs, "gamma": g, "tokens_per_s": round(tokens / wall, 3),
                         "decode_tokens_per_s": round(tokens / (wall - engine.stats.prefill_s), 3),
                         "target_prefill_s": round(engine.stats.prefill_s, 2),
                         "acceptance_rate": round(s.acceptance_rate, 4),
                         "mean_accepted_len": round(s.mean_accepted_len, 4) if g else 1.0,
                         "tokens": tokens, "wall_s": round(wall, 2),
                         "greedy_equal": sum(r.output_ids == ref[i] for i, r in enumerate(reqs)),
                         "requests": len(reqs),
                         # Same digest before and after a refactor = the same greedy tokens, request by request.
                         "outputs_sha256": outputs_digest(r.output_ids for r in reqs)})
            bar.set_postfix(bs=bs, g=g, tok_s=runs[-1]["tokens_per_s"], eq=runs[-1]["greedy_equal"])
            bar.update()
    bar.close()
    llama = llama + _llama_cpp(args)

    alone1 = next(r["tokens_per_s"] for r in runs if r["batch_size"] == 1 and r["gamma"] == 0)
    spec1 = [r for r in runs if r["batch_size"] == 1 and r["gamma"] > 0]
    best1 = max(spec1, key=lambda r: r["tokens_per_s"])

    hf_assisted = []
    for schedule, n_assist in (("constant", best1["gamma"]), ("heuristic", 20)):
        gc = draft.model.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = n_assist, schedule
        # constant: a pure fixed-gamma peer; heuristic: as HF ships it (confidence threshold on).
        gc.assistant_confidence_threshold = 0.0 if schedule == "constant" else 0.4
        t0, tokens, equal = time.perf_counter(), 0, 0
        for i, p in enumerate(tqdm(prompts, desc=f"HF assisted ({schedule})", file=sys.stderr)):
            out = hf_greedy(target, p, max_new, assistant_model=draft.model)
            tokens += len(out)
            equal += out == ref[i]
        wall = time.perf_counter() - t0
        hf_assisted.append({"schedule": schedule, "num_assistant_tokens": n_assist,
                            "tokens_per_s": round(tokens / wall, 3), "greedy_equal": equal})

    hf_alone = hf_tokens / hf_s
    by = {(r["batch_size"], r["gamma"]): r for r in runs}
    result = {
        "pair": {"target": Path(target_dir).name, "draft": Path(draft_dir).name, "note": note,
                 "dtype": "float32", "device": "cpu", "draft_variant": _variant(draft)},
        "workload": {"prompts": len(prompts), "source": getattr(args, "dataset", None) or "own",
                     "max_new_tokens": max_new},
        "runs": runs,
        "hf_assisted": hf_assisted,
        "target_alone_batch1_tokens_per_s": alone1,
        "hf_target_alone_tokens_per_s": round(hf_alone, 3),
        "speedup_batch1": {"starjar_best_gamma": best1["gamma"],
                           "starjar": round(best1["tokens_per_s"] / alone1, 3),
                           "hf_assisted_best": round(max(h["tokens_per_s"] for h in hf_assisted) / hf_alone, 3)},
        "decode_batch1": _decode_batch1(runs, llama),
        "batching_ratio": {f"{bs}_vs_1": round(by[(bs, 0)]["tokens_per_s"] / alone1, 3)
                           for bs in batch_sizes if bs > 1},
        # Best gamma over gamma 0 at every batch size: where speculation pays on this machine.
        "speedup_by_batch": {str(bs): {"best_gamma": max((g for g in gammas if g), key=lambda g: by[(bs, g)]
                                                         ["tokens_per_s"]),
                                       "speedup": round(max(by[(bs, g)]["tokens_per_s"] for g in gammas if g)
                                                        / by[(bs, 0)]["tokens_per_s"], 3)}
                             for bs in batch_sizes},
        "batching_fixed_length": fixed_length_batching(target, prompts[:16], max_new, batch_sizes),
        "greedy_equal_all": all(r["greedy_equal"] == r["requests"] for r in runs)
        and all(h["greedy_equal"] == len(prompts) for h in hf_assisted),
        "switching_cost": switching_cost(draft, prompts, quick),
        # The target's bytes per token, the machine's read bandwidth and how near the decode rate is to their floor.
        "memory_floor": (floor := memory_floor(target, prompts[0][:64])),
    }
    print(f"target alone at batch 1: {floor['decode_batch1_tokens_per_s']} tokens/s decoding "
          f"({floor['decode_gb_per_s']} GB/s), {floor['fraction_of_floor']:.0%} of the memory floor "
          f"({floor['bytes_per_token'] / 1e6:.0f} MB a token at {floor['read_bandwidth_gb_per_s']} GB/s read: "
          f"{floor['floor_tokens_per_s']} tokens/s; each run against a probe just before it); "
          f"{floor['fraction_of_sustained']:.0%} of the rate the memory sustains over as long as a run "
          f"({floor['sustained_read_gb_per_s']} GB/s)", file=sys.stderr)
    dec = result["decode_batch1"]
    print(f"batch 1, target prefill left out: best speculation (gamma {dec['best_gamma']}) {dec['best_tokens_per_s']} "
          f"tokens/s, {dec['best_over_target_alone']}x the target alone"
          + (f", {dec['best_over_llama_cpp']}x llama.cpp's tg128" if "best_over_llama_cpp" in dec else ""),
          file=sys.stderr)
    return result


def _llama_cpp(args) -> list[float]:
    """llama.cpp's tg128 tokens/s on this run's threads, when --llama-bench and --gguf are given."""
    if not (getattr(args, "llama_bench", None) and getattr(args, "gguf", None)):
        return []
    from benchmarks.probes.llama_cpp_reference import llama_bench

    return [round(llama_bench(args.llama_bench, args.gguf, torch.get_num_threads(), 128, 3), 2)]


def _decode_batch1(runs: list[dict], llama: list[float]) -> dict:
    """Batch 1 with the target's prefill left out: the best gamma over gamma 0, and over llama.cpp's tg128."""
    b1 = [r for r in runs if r["batch_size"] == 1]
    alone = next(r["decode_tokens_per_s"] for r in b1 if r["gamma"] == 0)
    best = max((r for r in b1 if r["gamma"]), key=lambda r: r["decode_tokens_per_s"])
    out = {"target_alone_tokens_per_s": alone, "best_gamma": best["gamma"],
           "best_tokens_per_s": best["decode_tokens_per_s"],
           "best_over_target_alone": round(best["decode_tokens_per_s"] / alone, 3)}
    if llama:
        ref = statistics.mean(llama)
        out.update(llama_cpp_tg128_tokens_per_s=llama, best_over_llama_cpp=round(best["decode_tokens_per_s"] / ref, 3),
                   target_alone_over_llama_cpp=round(alone / ref, 3))
    return out


def outputs_digest(outputs) -> str:
    h = hashlib.sha256()
    for ids in outputs:
        h.update(",".join(map(str, ids)).encode() + b";")
    return h.hexdigest()[:16]


def fixed_length_batching(target, prompts, max_new: int, batch_sizes: list[int]) -> dict:
    """Target alone with every output exactly max_new tokens (ignore_eos): decode-dominated
    throughput per batch size, as a serving benchmark with fixed output lengths measures it."""
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    rates = {}
    for bs in batch_sizes:
        engine = colocated_engine(target, None, 0, bs)
        t0 = time.perf_counter()
        reqs = engine.generate(prompts, params)
        rates[bs] = sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t0)
    return {"prompts": len(prompts), "max_new_tokens": max_new,
            "tokens_per_s": {str(b): round(r, 3) for b, r in rates.items()},
            "ratio_vs_1": {str(b): round(r / rates[1], 3) for b, r in rates.items() if b > 1}}


def switching_cost(draft, prompts, quick: bool) -> list[dict]:
    """Draft catch-up prefill time after L speculation-free tokens, per batch size.

    The extra time over L = 1 (the normal one-token catch-up of every round) is what a
    sequence pays to resume speculation: Nightjar's C_switch on the draft side.
    """
    rows = []
    lengths = [1, 8, 32] if quick else [1, 8, 32, 64]
    for bs in ([1, 4] if quick else [1, 4, 16]):
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        for L in lengths:
            times = []
            for _ in range(3):
                eng = DraftEngine(draft)
                eng.propose([DraftRequest(i, 0, p, 1) for i, p in enumerate(batch)])
                extra = [[(7 + i + j) % 1000 + 100 for j in range(L)] for i in range(bs)]
                before = eng.stats.catchup_s
                eng.propose([DraftRequest(i, len(p), e, 1) for i, (p, e) in enumerate(zip(batch, extra, strict=True))])
                times.append(eng.stats.catchup_s - before)
            rows.append({"batch_size": bs, "catchup_tokens": L, "catchup_ms": round(1000 * sorted(times)[1], 3)})
    return rows


def _variant(draft) -> dict:
    """Which int8 kernel and head the draft ran with (what `starjar models build` chose, or a forced path)."""
    from starjar.cpu.quantized import RowInt8Linear

    paths = sorted({m.path for m in draft.model.modules() if isinstance(m, RowInt8Linear) and not m.wide})
    head = draft.lean.head.out_features if draft.lean is not None and draft.lean.head is not None else None
    return {"int8_kernel": paths, "head_vocab": head, "lean_forward": draft.lean is not None}
