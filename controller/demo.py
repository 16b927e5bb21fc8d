"""`starjar demo`: the default pair on a short Spec-Bench workload, target alone vs speculative.

Prints a summary table; both runs are greedy, so their outputs must be identical.
"""

from __future__ import annotations

import statistics
import sys
import time

from tqdm import tqdm

from controller.colocated import colocated_engine, load_pair
from starjar.default_pair import DRAFT_NOTE, build_default_pair
from starjar.sampling import SamplingParams
from starjar.text import encode_prompt
from starjar.workloads import spec_bench_prompts


def _run(engine, prompts, params, label):
    bar = tqdm(total=len(prompts), desc=label, unit="req", file=sys.stderr)
    t0 = time.perf_counter()
    def on_step(outs):
        done = sum(o.finished for o in outs)
        if done:
            bar.update(done)

    reqs = engine.generate(prompts, params, on_step=on_step)
    wall = time.perf_counter() - t0
    bar.close()
    tokens = sum(len(r.output_ids) for r in reqs)
    ttft = [r.first_token_s - t0 for r in reqs]
    tpot = [(r.finish_s - r.first_token_s) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    return reqs, {"tokens": tokens, "wall": wall, "tok_s": tokens / wall,
                  "ttft_p50": statistics.median(ttft), "tpot_p50": statistics.median(tpot) if tpot else 0.0}


def run_demo(args) -> int:
    print("building the default pair (cached after the first run) ...", file=sys.stderr)
    pair = build_default_pair()
    target, draft = load_pair(pair["target"], pair["draft"])
    tok = target.tokenizer
    texts = spec_bench_prompts(args.requests)
    prompts = [encode_prompt(tok, t, chat=True) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens)
    colocated_engine(target, None, 0, args.batch_size).generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    base_reqs, base = _run(colocated_engine(target, None, 0, args.batch_size), prompts, params, "target alone")
    spec_engine = colocated_engine(target, draft, args.gamma, args.batch_size)
    spec_reqs, spec = _run(spec_engine, prompts, params, f"speculative gamma={args.gamma}")
    same = sum(a.output_ids == b.output_ids for a, b in zip(base_reqs, spec_reqs))
    s = spec_engine.stats

    print(f"\nstarjar demo: target {target.path}\n              draft  {draft.path}\n"
          f"              ({DRAFT_NOTE})")
    print(f"{len(prompts)} Spec-Bench prompts, chat template, greedy, max {args.max_tokens} new tokens, "
          f"batch {args.batch_size}, CPU fp32\n")
    print(f"{'run':<24}{'tokens':>8}{'tok/s':>9}{'TTFT p50':>11}{'TPOT p50':>11}{'accept':>8}")
    print(f"{'target alone':<24}{base['tokens']:>8}{base['tok_s']:>9.1f}{base['ttft_p50']:>10.2f}s"
          f"{base['tpot_p50'] * 1000:>9.0f}ms{'-':>8}")
    print(f"{f'speculative gamma={args.gamma}':<24}{spec['tokens']:>8}{spec['tok_s']:>9.1f}{spec['ttft_p50']:>10.2f}s"
          f"{spec['tpot_p50'] * 1000:>9.0f}ms{s.acceptance_rate:>8.2f}")
    print(f"\nspeedup {spec['tok_s'] / base['tok_s']:.2f}x; identical outputs {same}/{len(prompts)} (lossless)")
    print(f"\nsample: {texts[0][:70]!r}\n  -> {tok.decode(spec_reqs[0].output_ids, skip_special_tokens=True)[:200]!r}")
    return 0 if same == len(prompts) else 1
