"""`starjar bench adaserve`: token trees and per-request TPOT SLOs (AdaServe) on the real default pair.

Three parts, one run, same target, draft and prompts (ratios hold on this machine only):
  budget    the verification budget: tokens per target pass at batch 1 while the pass time stays within
            1.25x of a one-token pass (the profile the tree policies are given);
  batch1    tokens/s at batch 1, the best tree (width x depth, adaserve selection under the budget) against
            the best chain (gamma) with the same in-process draft; greedy output checked against HF generate;
            the draft's tree-building cost per round and the selection's overhead per step;
  slo       Poisson arrivals at several rates, SLO classes (the target alone's TPOT, 1.5x, 5x) mixed
            60/20/20; per policy and rate: SLO attainment, goodput (tokens/s of requests that met their SLO)
            and mean TPOT.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from benchmarks.common import p50, pair_dirs, prompt_ids, save_plot
from controller.colocated import load_pair
from draft_server.engine import DraftEngine
from starjar.policy import FixedGamma
from starjar.reference import hf_greedy
from starjar.sampling import SamplingParams
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.tree_budget import measure_verify_budget
from target_worker.tree_score import TreeConfig

POLICIES = ("adaserve", "global_greedy", "equal_greedy", "fixed", "chain", "none")
MIN_BUDGET = 8


def run(args) -> dict:
    quick = args.quick
    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_pair(target_dir, draft_dir)
    prompts = prompt_ids(target.tokenizer, 24)
    engine_for(target, draft, "none", 1, 1, 8).generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
    budget = measure_verify_budget(target, prompts[0])
    # On a CPU the pass time grows from the second token on (compute-bound), so the profiled budget can be 1:
    # no room for any tree. The tree policies then get at least MIN_BUDGET, and the JSON says so.
    used = max(budget["budget"], MIN_BUDGET)
    b1 = batch1(target, draft, prompts[: 2 if quick else 6], 24 if quick else 48, quick)
    slo = slo_sweep(target, draft, prompts, used, b1, quick)
    out = {"note": note, "budget_profile": budget, "budget_used": used, "batch1": b1, **slo}
    plot = Path(args.out).with_name(Path(args.out).stem + "_attainment.png")
    out["plot"] = save_plot(plot, "SLO attainment vs rate (AdaServe classes 60/20/20)",
                            {p: (slo["rates"], [r["attainment"] for r in rows]) for p, rows in slo["policies"].items()},
                            "requests/s", "SLO attainment")
    return out


def engine_for(target, draft, policy: str, gamma: int, batch: int, budget: int, width: int = 3,
               cap: int = 16) -> TargetEngine:
    """One switch for every policy: tree policies select from draft trees; chain is today's chains; none: no
    speculation."""
    if policy == "none":
        return TargetEngine(target, None, FixedGamma(0), EngineConfig(max_batch_size=batch))
    tree = TreeConfig(policy, width, budget, cap) if policy != "chain" else None
    cfg = EngineConfig(max_batch_size=batch, max_gamma=max(gamma, 1), tree=tree)
    return TargetEngine(target, DraftEngine(draft), FixedGamma(gamma), cfg)


def batch1(target, draft, prompts, max_new: int, quick: bool) -> dict:
    """Batch 1: chains over gamma, trees over (depth, width, budget) with adaserve selection, plain decoding;
    every run's greedy output checked against HF generate."""
    ref = [hf_greedy(target, p, max_new) for p in prompts]
    params = SamplingParams(max_tokens=max_new)
    configs = [("none", 0, 0, 0)] + [("chain", g, 0, 0) for g in ((3, 5) if quick else (2, 3, 4, 5, 6, 8))]
    configs += [("adaserve", d, w, b) for d, w, b in (((4, 2, 8), (6, 2, 12)) if quick else
                                                      ((4, 2, 8), (6, 2, 12), (8, 2, 16), (4, 3, 12), (6, 3, 16)))]
    runs = []
    for policy, depth, width, budget in configs:
        engine = engine_for(target, draft, policy, depth, 1, budget, max(width, 1), cap=max(1, budget - 1))
        t0 = time.perf_counter()
        reqs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(len(r.output_ids) for r in reqs)
        row = {"policy": policy, "depth": depth, "width": width, "budget": budget,
               "tokens_per_s": round(tokens / wall, 3),
               "exact": [r.output_ids for r in reqs] == ref,
               "mean_accepted_len": round(engine.stats.mean_accepted_len, 3)}
        ds = engine.proposer.stats if engine.proposer is not None else None
        if ds is not None and ds.rounds:
            row["draft_s_per_round"] = round((ds.catchup_s + ds.step_s) / ds.rounds, 5)
        if ds is not None and ds.tree_jobs:
            row["tree_nodes_per_round"] = round(ds.tree_nodes / ds.tree_jobs, 2)
            row["tree_expand_us_per_round"] = round(1e6 * ds.tree_expand_s / ds.tree_jobs, 1)
        if engine.trees is not None and engine.trees.select_s:
            row["selection_us_p50"] = round(1e6 * p50(engine.trees.select_s), 1)
        runs.append(row)
        print(row, file=sys.stderr)
    best = {k: max((r for r in runs if (r["policy"] == "adaserve") == (k == "tree") and r["policy"] != "none"),
                   key=lambda r: r["tokens_per_s"]) for k in ("tree", "chain")}
    alone = next(r for r in runs if r["policy"] == "none")
    return {"prompts": len(prompts), "max_tokens": max_new, "runs": runs, "best_tree": best["tree"],
            "best_chain": best["chain"], "tree_over_chain": round(best["tree"]["tokens_per_s"] /
                                                                  best["chain"]["tokens_per_s"], 3),
            "target_alone_tpot_s": round(1 / alone["tokens_per_s"], 5), "all_exact": all(r["exact"] for r in runs)}


def slo_sweep(target, draft, prompts, budget: int, b1: dict, quick: bool) -> dict:
    """Poisson arrivals; SLO classes from the target alone's TPOT at batch 1 (AdaServe Table 2, scaled)."""
    tpot0 = b1["target_alone_tpot_s"]
    classes, weights = (tpot0, 1.5 * tpot0, 5 * tpot0), (0.6, 0.2, 0.2)
    n_req, max_new = (6, 12) if quick else (24, 32)
    capacity = 1 / (tpot0 * max_new)  # requests/s that batch-1 plain decoding sustains
    rates = [round(capacity * m, 3) for m in ((1, 3) if quick else (0.5, 1, 2, 4, 8))]
    best_chain = b1["best_chain"]["depth"]
    best_tree = b1["best_tree"]
    policies: dict[str, list] = {p: [] for p in POLICIES}
    overhead = []
    for rate in rates:
        rng = random.Random(17)
        arrivals, t = [], 0.0
        for i in range(n_req):
            t += rng.expovariate(rate)
            arrivals.append((t, prompts[i % len(prompts)], rng.choices(classes, weights)[0]))
        for policy in POLICIES:
            depth = best_chain if policy == "chain" else best_tree["depth"]
            engine = engine_for(target, draft, policy, depth, 8, budget, max(1, best_tree["width"]))
            row = _open_loop(engine, arrivals, max_new)
            row["rate"] = rate
            policies[policy].append(row)
            if engine.trees is not None:
                overhead += engine.trees.select_s
            print(policy, row, file=sys.stderr)
    return {"rates": rates, "slo_classes_s": [round(c, 5) for c in classes], "requests_per_rate": n_req,
            "policies": policies, "scheduling_overhead_us_p50": round(1e6 * p50(overhead), 1)}


def _open_loop(engine: TargetEngine, arrivals, max_new: int) -> dict:
    """Requests join at their arrival times; each one's TPOT (first token to last) against its SLO."""
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    start = time.perf_counter()
    pending, reqs = list(arrivals), []
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, prompt, slo = pending.pop(0)
            req = engine.add_request(prompt, params)
            req.tpot_slo_s = slo
            reqs.append(req)
        if engine.has_work():
            engine.step()
        elif pending:
            time.sleep(min(0.01, pending[0][0] - now))
    makespan = time.perf_counter() - start
    tpots = [(r.finish_s - r.first_token_s) / max(1, len(r.output_ids) - 1) for r in reqs]
    met = [t <= r.tpot_slo_s for t, r in zip(tpots, reqs, strict=True)]
    good = sum(len(r.output_ids) for r, m in zip(reqs, met, strict=True) if m)
    return {"attainment": round(sum(met) / len(reqs), 3), "goodput_tokens_per_s": round(good / makespan, 3),
            "mean_tpot_s": round(sum(tpots) / len(tpots), 5)}
