"""`starjar bench draft`: how well the default draft predicts the target, and what it buys.

- Acceptance at gamma = 3 per prompt category (starjar's own set, or Spec-Bench's
  with --dataset; the draft is not trained on anything, so every category is held out), and on pair_check's six. Prompts
  go through the chat template: the target is an instruct model, and without
  it several categories answer with EOS at once, leaving nothing to measure.
- Batch 1, greedy, same prompts, one run: the target alone vs speculative at
  gamma 1..5 (outputs must be identical), and the best speedup.
- The cost ratio: one draft step over one target step, same context.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from tqdm import tqdm

from benchmarks.common import pair_dirs, prompt_texts
from controller.colocated import colocated_engine, load_pair
from controller.tuning.pair_check import OWN_PROMPTS
from starjar.model.text import encode_prompt
from starjar.spec.sampling import SamplingParams


def _step_ms(model, prompt, q: int = 1, reps: int = 15) -> float:
    cache = model.new_cache()
    slot = cache.allocate()
    model.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward(cache, [slot], [[prompt[-1]] * q], [list(range(q))])
        times.append(time.perf_counter() - t0)
        cache.truncate(slot, cache.lengths[slot] - q)
    return 1000 * sorted(times)[reps // 2]


def run(args) -> dict:
    per_cat, max_new = (2, 24) if args.quick else (4, 48)
    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_pair(target_dir, draft_dir)
    tok = target.tokenizer
    by_cat: dict[str, list[str]] = defaultdict(list)
    for p in prompt_texts(args, None):
        if len(by_cat[p.category]) < per_cat:
            by_cat[p.category].append(p.text)
    by_cat["own prompts"] = OWN_PROMPTS[: per_cat + 2]
    params = SamplingParams(max_tokens=max_new)

    acceptance = {}
    for cat, texts in tqdm(sorted(by_cat.items()), desc="acceptance by category (gamma 3)", file=sys.stderr):
        eng = colocated_engine(target, draft, 3, 1)
        eng.generate([encode_prompt(tok, t, chat=True)[:400] for t in texts], params)
        acceptance[cat] = {"acceptance_rate": round(eng.stats.acceptance_rate, 4),
                           "mean_accepted_len": round(eng.stats.mean_accepted_len, 3), "prompts": len(texts)}
    overall = [v["acceptance_rate"] for v in acceptance.values()]

    # Speed at batch 1: a mixed set, two prompts of each category.
    prompts = [encode_prompt(tok, t, chat=True)[:400] for cat, texts in sorted(by_cat.items()) if cat != "own prompts"
               for t in texts[:1 if args.quick else 2]]
    colocated_engine(target, draft, 3, 1).generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
    speed, base_out = [], None
    for g in tqdm([0, 1, 2, 3, 4, 5], desc="batch 1 speed", file=sys.stderr):
        eng = colocated_engine(target, draft if g else None, g, 1)
        t0 = time.perf_counter()
        reqs = eng.generate(prompts, params)
        wall = time.perf_counter() - t0
        outs = [r.output_ids for r in reqs]
        base_out = base_out or outs
        speed.append({"gamma": g, "tokens_per_s": round(sum(map(len, outs)) / wall, 3),
                      "acceptance_rate": round(eng.stats.acceptance_rate, 4), "identical": outs == base_out})
    alone = speed[0]["tokens_per_s"]
    best = max(speed[1:], key=lambda r: r["tokens_per_s"])
    ctx = prompts[0]
    t_step, d_step = _step_ms(target, ctx), _step_ms(draft, ctx)
    return {"pair": {"target": target_dir, "draft": draft_dir, "note": note},
            "acceptance_gamma3_by_category": acceptance,
            "acceptance_gamma3_min": min(overall), "acceptance_gamma3_mean": round(sum(overall) / len(overall), 4),
            "batch1": {"prompts": len(prompts), "max_new_tokens": max_new, "runs": speed,
                       "target_alone_tokens_per_s": alone, "best_gamma": best["gamma"],
                       "best_speedup": round(best["tokens_per_s"] / alone, 3)},
            "cost": {"target_step_ms": round(t_step, 2), "draft_step_ms": round(d_step, 2),
                     "draft_over_target": round(d_step / t_step, 3)}}
