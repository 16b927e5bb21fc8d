"""`starjar bench adaserve`: token trees and per-request TPOT SLOs (AdaServe) on the real default pair, the
drafts from a real `starjar serve draft` process over gRPC (--in-process-draft: in the bench's process).

Three parts, same target, draft and prompts (ratios hold on this machine only); --parts picks, --from-json
carries an earlier part's results over, so a long sweep can run as several short ones:
  budget    the verification budget: tokens per target pass at batch 1 while the pass time stays within
            1.25x of a one-token pass (the profile the tree policies are given);
  batch1    tokens/s at batch 1, the best tree (width x depth, adaserve selection under the budget) against
            the best chain (gamma) with the same draft; greedy output checked against HF generate;
            the draft's tree-building cost per round and the selection's overhead per step;
  slo       Poisson arrivals at several rates, SLO classes (the target alone's TPOT, 1.5x, 5x) mixed
            60/20/20; per policy and rate: SLO attainment, goodput (tokens/s of requests that met their SLO)
            and mean TPOT.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.adaserve_draft import DraftSource
from benchmarks.common import p50, pair_dirs, prompt_ids, save_plot
from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import load_pair
from draft_server.engine import DraftStats
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.tree_budget import measure_verify_budget
from target_worker.tree_score import TreeConfig

POLICIES = ("adaserve", "global_greedy", "equal_greedy", "fixed", "chain", "none")
MIN_BUDGET = 8
RATES = (0.5, 1, 2, 4, 8)  # multiples of the requests/s that batch-1 plain decoding sustains


def run(args) -> dict:
    quick = args.quick
    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_pair(target_dir, draft_dir)
    earlier = json.loads(Path(args.from_json).read_text()) if args.from_json else {}
    parts = set((args.parts or "batch1,slo").split(","))
    if not args.in_process_draft:
        torch.set_num_threads(1)  # the draft server process has the other core
    source = DraftSource(target, draft, draft_dir, args.in_process_draft)
    try:
        prompts = prompt_ids(target.tokenizer, 24, args)
        engine_for(target, None, "none", 1, 1, 8).generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
        budget = earlier.get("budget_profile") or measure_verify_budget(target, prompts[0])
        # On a CPU the pass time grows from the second token on (compute-bound), so the profiled budget can be
        # 1: no room for any tree. The tree policies then get at least MIN_BUDGET, and the JSON says so.
        used = args.budget or max(budget["budget"], MIN_BUDGET)
        out = {"note": note, **source.describe(), "target_threads": torch.get_num_threads(), "budget_profile": budget,
               "budget_used": used}
        b1 = batch1(target, source, prompts[: 2 if quick else 6], 24 if quick else 48, quick) \
            if "batch1" in parts else earlier["batch1"]
        out["batch1"] = b1
        if "slo" in parts:
            rates = tuple(float(x) for x in args.rates.split(",")) if args.rates else ((1, 3) if quick else RATES)
            out.update(slo_sweep(target, source, prompts, used, b1, rates, args.requests or (6 if quick else 24),
                                 args.max_new or (12 if quick else 32), earlier))
    finally:
        source.close()
    if "policies" in out:
        plot = Path(args.out).with_name(Path(args.out).stem + "_attainment.png")
        out["plot"] = save_plot(plot, "SLO attainment vs rate (AdaServe classes 60/20/20)",
                                {p: (out["rates"], [r["attainment"] for r in rows])
                                 for p, rows in out["policies"].items()},
                                "requests/s", "SLO attainment")
        out["verdict"] = verdict(out["policies"])
    return out


def engine_for(target, proposer, policy: str, gamma: int, batch: int, budget: int, width: int = 3,
               cap: int = 16) -> TargetEngine:
    """One switch for every policy (as `--tree`): tree policies select from draft trees; chain is today's
    chains; none: no speculation."""
    if policy == "none":
        return TargetEngine(target, None, FixedGamma(0), EngineConfig(max_batch_size=batch))
    tree = TreeConfig(policy, width, budget, cap) if policy != "chain" else None
    cfg = EngineConfig(max_batch_size=batch, max_gamma=max(gamma, 1), tree=tree)
    return TargetEngine(target, proposer, FixedGamma(gamma), cfg)


def batch1(target, source, prompts, max_new: int, quick: bool) -> dict:
    """Batch 1: chains over gamma, trees over (depth, width, budget) with adaserve selection, plain decoding;
    every run's greedy output checked against HF generate."""
    ref = [hf_greedy(target, p, max_new) for p in prompts]
    params = SamplingParams(max_tokens=max_new)
    configs = [("none", 0, 0, 0)] + [("chain", g, 0, 0) for g in ((3, 5) if quick else (2, 3, 4, 5, 6))]
    configs += [("adaserve", d, w, b) for d, w, b in (((4, 2, 8), (6, 2, 12)) if quick else
                                                      ((3, 2, 4), (4, 2, 8), (6, 2, 12), (4, 3, 12), (3, 3, 8)))]
    runs = []
    for policy, depth, width, budget in configs:
        proposer = source.proposer() if policy != "none" else None
        engine = engine_for(target, proposer, policy, depth, 1, budget, max(width, 1), cap=max(1, budget - 1))
        before = source.stats()
        t0 = time.perf_counter()
        reqs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(len(r.output_ids) for r in reqs)
        row = {"policy": policy, "depth": depth, "width": width, "budget": budget,
               "tokens_per_s": round(tokens / wall, 3),
               "exact": [r.output_ids for r in reqs] == ref,
               "mean_accepted_len": round(engine.stats.mean_accepted_len, 3), "tree_rounds": engine.stats.tree_rounds}
        row.update(_draft_costs(engine, source, before))
        source.release(proposer)
        runs.append(row)
        print(row, file=sys.stderr)
    best = {k: max((r for r in runs if (r["policy"] == "adaserve") == (k == "tree") and r["policy"] != "none"),
                   key=lambda r: r["tokens_per_s"]) for k in ("tree", "chain")}
    alone = next(r for r in runs if r["policy"] == "none")
    return {"prompts": len(prompts), "max_tokens": max_new, "runs": runs, "best_tree": best["tree"],
            "best_chain": best["chain"], "tree_over_chain": round(best["tree"]["tokens_per_s"] /
                                                                  best["chain"]["tokens_per_s"], 3),
            "target_alone_tpot_s": round(1 / alone["tokens_per_s"], 5), "all_exact": all(r["exact"] for r in runs)}


def _draft_costs(engine, source, before: dict) -> dict:
    """Per draft round: its time as the target saw it, and the tree-building cost on the draft."""
    row = {}
    ps = engine.proposer.stats if engine.proposer is not None else None
    if isinstance(ps, DraftStats) and ps.rounds:
        row["draft_s_per_round"] = round((ps.catchup_s + ps.step_s) / ps.rounds, 5)
        if ps.tree_jobs:
            row["tree_nodes_per_round"] = round(ps.tree_nodes / ps.tree_jobs, 2)
            row["tree_expand_us_per_round"] = round(1e6 * ps.tree_expand_s / ps.tree_jobs, 1)
    elif ps is not None and ps.round_s:
        row["draft_s_per_round"] = round(sum(ps.round_s) / len(ps.round_s), 5)  # over gRPC, as waited for
        row["draft_server_compute_s_per_round"] = round(sum(ps.server_compute_s) / len(ps.server_compute_s), 5)
        row["draft_fallbacks"] = sum(ps.fallbacks.values())
        after = source.stats()
        jobs = after["tree_rounds"] - before["tree_rounds"]
        if jobs:
            row["tree_nodes_per_round"] = round((after["tree_nodes"] - before["tree_nodes"]) / jobs, 2)
            row["tree_expand_us_per_round"] = round(1e6 * (after["tree_expand_s"] - before["tree_expand_s"]) / jobs,
                                                    1)
    if engine.trees is not None and engine.trees.select_s:
        row["selection_us_p50"] = round(1e6 * p50(engine.trees.select_s), 1)
    return row


def slo_sweep(target, source, prompts, budget: int, b1: dict, multiples, n_req: int, max_new: int,
              earlier: dict) -> dict:
    """Poisson arrivals; SLO classes from the target alone's TPOT at batch 1 (AdaServe Table 2, scaled). Rows of
    an earlier run with the same classes (`earlier`, from --from-json) are kept, so a sweep can run in parts."""
    tpot0 = b1["target_alone_tpot_s"]
    classes, weights = (tpot0, 1.5 * tpot0, 5 * tpot0), (0.6, 0.2, 0.2)
    capacity = 1 / (tpot0 * max_new)  # requests/s that batch-1 plain decoding sustains
    rates = [round(capacity * m, 3) for m in multiples]
    best_chain = b1["best_chain"]["depth"]
    best_tree = b1["best_tree"]
    policies: dict[str, list] = {p: list(earlier.get("policies", {}).get(p, [])) for p in POLICIES}
    overhead = []
    for rate in rates:
        rng = random.Random(17)
        arrivals, t = [], 0.0
        for i in range(n_req):
            t += rng.expovariate(rate)
            arrivals.append((t, prompts[i % len(prompts)], rng.choices(classes, weights)[0]))
        for policy in POLICIES:
            depth = best_chain if policy == "chain" else best_tree["depth"]
            proposer = source.proposer() if policy != "none" else None
            engine = engine_for(target, proposer, policy, depth, 8, budget, max(1, best_tree["width"]))
            before = source.stats()
            row = _open_loop(engine, arrivals, max_new)
            row.update(_draft_costs(engine, source, before))  # draft round, tree build, selection: per policy
            source.release(proposer)
            row.update(rate=rate, requests=n_req, max_tokens=max_new, tree_rounds=engine.stats.tree_rounds)
            policies[policy].append(row)
            if engine.trees is not None:
                overhead += engine.trees.select_s
            print(policy, row, file=sys.stderr)
    for rows in policies.values():
        rows.sort(key=lambda r: r["rate"])
    return {"rates": sorted({r["rate"] for r in policies["none"]}), "slo_classes_s": [round(c, 5) for c in classes],
            "requests_per_rate": n_req, "policies": policies,
            "scheduling_overhead_us_p50": round(1e6 * p50(overhead), 1),
            **({"earlier_scheduling_overhead_us_p50": earlier["scheduling_overhead_us_p50"]}
               if "scheduling_overhead_us_p50" in earlier else {})}


def verdict(policies: dict) -> dict:
    """The headline: at the highest rate where any baseline still attains 50%, AdaServe's attainment
    and goodput over the best baseline's."""
    rates = [r["rate"] for r in policies["adaserve"]]
    base = [p for p in policies if p != "adaserve"]
    ok = [i for i, _ in enumerate(rates) if any(policies[p][i]["attainment"] >= 0.5 for p in base)]
    if not ok:
        return {"rate": None, "note": "no baseline attains 50% at any rate"}
    i = ok[-1]
    best_att = max(base, key=lambda p: policies[p][i]["attainment"])
    best_good = max(base, key=lambda p: policies[p][i]["goodput_tokens_per_s"])
    ada = policies["adaserve"][i]
    return {"rate": rates[i], "best_baseline_attainment": [best_att, policies[best_att][i]["attainment"]],
            "best_baseline_goodput": [best_good, policies[best_good][i]["goodput_tokens_per_s"]],
            "adaserve": [ada["attainment"], ada["goodput_tokens_per_s"]],
            "attainment_ratio": round(ada["attainment"] / max(1e-9, policies[best_att][i]["attainment"]), 3),
            "goodput_ratio": round(ada["goodput_tokens_per_s"] / max(1e-9, policies[best_good][i]
                                                                     ["goodput_tokens_per_s"]), 3)}


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
