"""`starjar bench nightjar`: Nightjar against every baseline, on a dynamic trace and at static rates.

Simulated target worker (benchmarks/nightjar_sim.py) on this machine's measured
cost model (`starjar profile` of the default pair, benchmarks/results/
profile-default-pair.json unless --profile) and acceptance measured per
Spec-Bench category (benchmarks/results/draft-default-pair.json). Arrivals:
the Azure conversation trace's inter-arrival gaps, time-rescaled to this
machine's capacity: half of capacity, with a middle third whose rate rises to
1.5x capacity and falls back (dynamic); and Poisson arrivals from 0.1x to 1.3x
capacity (static). (A base of 0.2x left the machine idle most of the time:
every policy's throughput was then the arrival rate, 47.08 +- 0.02 tok/s.) Output
lengths come from the trace (8 to 256 tokens), prompt lengths from Spec-Bench.
Capacity is what the target alone sustains when every request is queued at
once. Each figure is the mean over seeds.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.nightjar_sim import (CostModel, SimRequest, alpha_from_mean_accepted, poisson_arrivals,
                                     rise_and_fall, simulate, warp_trace)
from starjar.policies import make_policy
from starjar.policies.nightjar import CSwitchTable
from starjar.workloads import data_dir

RESULTS = Path(__file__).resolve().parent / "results"
MAX_GAMMA = 4
MAX_BATCH = 16
DYNAMIC_LOW, DYNAMIC_PEAK = 0.5, 1.5  # fractions of capacity
POLICIES = ["nightjar", "nightjar_paper", "none"] + [f"fixed_{g}" for g in range(1, MAX_GAMMA + 1)] + \
    ["dsd", "banditspec", "tide", "vllm_table", "sglang_ema", "hf_heuristic"]


def _trace(n: int) -> tuple[list[float], list[int], list[int]]:
    rows = list(csv.DictReader((data_dir() / "azure" / "AzureLLMInferenceTrace_conv.csv").open()))[: n + 1]
    from datetime import datetime

    ts = [datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp() for r in rows]
    gaps = [max(1e-3, b - a) for a, b in zip(ts, ts[1:])]
    outs = [min(256, max(8, int(r["GeneratedTokens"]))) for r in rows[:n]]
    # Prompts are Spec-Bench's (chat template included: about 4 characters per token plus 30 template tokens).
    from starjar.workloads import spec_bench_mix

    texts = spec_bench_mix(80)
    prompts = [30 + len(texts[k % len(texts)]) // 4 for k in range(n)]
    return gaps, outs, prompts


def _alphas() -> list[float]:
    d = json.loads((RESULTS / "draft-default-pair.json").read_text())
    return [alpha_from_mean_accepted(v["mean_accepted_len"]) for v in d["acceptance_gamma3_by_category"].values()]


def _requests(arrivals, outs, prompts, alphas) -> list[SimRequest]:
    return [SimRequest(a, o, alphas[k % len(alphas)], p) for k, (a, o, p) in enumerate(zip(arrivals, outs, prompts))]


def _run_all(requests, cost, profile, seeds, record=False) -> tuple[dict, list]:
    out, trace = {}, []
    for name in POLICIES:
        tps, e2e = [], []
        for s in seeds:
            policy = make_policy(name, MAX_GAMMA, CSwitchTable.from_dict(profile["cswitch"]), profile, seed=s)
            res = simulate(policy, requests, cost, MAX_BATCH, seed=s, record=record and name == "nightjar")
            tps.append(res.tokens_per_s)
            e2e.append(res.mean_e2e_s)
            if res.gammas and not trace:
                trace = res.gammas
        out[name] = {"tokens_per_s": round(sum(tps) / len(tps), 3), "mean_e2e_s": round(sum(e2e) / len(e2e), 3)}
    return out, trace


def _ratios(table: dict) -> dict:
    fixed = {k: v["tokens_per_s"] for k, v in table.items() if k.startswith("fixed_")}
    best_fixed = max(fixed, key=fixed.get)
    nj = table["nightjar"]["tokens_per_s"]
    return {"best_fixed": best_fixed, "nightjar_over_best_fixed": round(nj / fixed[best_fixed], 3),
            "nightjar_over_none": round(nj / table["none"]["tokens_per_s"], 3),
            "nightjar_over_dsd": round(nj / table["dsd"]["tokens_per_s"], 3),
            "nightjar_over_banditspec": round(nj / table["banditspec"]["tokens_per_s"], 3),
            "best_overall": max(table, key=lambda k: table[k]["tokens_per_s"])}


def run(args) -> dict:
    profile_path = Path(getattr(args, "profile", None) or RESULTS / "profile-default-pair.json")
    profile = json.loads(profile_path.read_text())
    cost = CostModel(profile)
    alphas = _alphas()
    n = 300 if args.quick else 1200
    seeds = [0, 1] if args.quick else [0, 1, 2]
    gaps, outs, prompts = _trace(n)
    mean_out = sum(outs) / len(outs)
    # Capacity: requests/s the target alone sustains, from a simulated run with every request queued at once.
    flood = _requests([0.0] * n, outs, prompts, alphas)
    capacity = simulate(make_policy("none"), flood, cost, MAX_BATCH).tokens_per_s / mean_out

    bar = tqdm(total=6, desc="nightjar bench (simulated)", file=sys.stderr)
    dyn_arrivals = warp_trace(gaps, rise_and_fall(n, DYNAMIC_LOW * capacity, DYNAMIC_PEAK * capacity))
    dynamic, gamma_trace = _run_all(_requests(dyn_arrivals, outs, prompts, alphas), cost, profile, seeds,
                                    record=True)
    bar.update()
    static = {}
    for frac in (0.1, 0.3, 0.6, 0.9, 1.3):
        rate = frac * capacity
        reqs = _requests(poisson_arrivals(rate, n, seed=7), outs, prompts, alphas)
        static[f"{rate:.3f}"] = dict(_run_all(reqs, cost, profile, seeds)[0], load_fraction=frac)
        bar.update()
    bar.close()
    summary = {"dynamic": _ratios(dynamic),
               "static": {r: _ratios({k: v for k, v in t.items() if k != "load_fraction"})
                          for r, t in static.items()}}
    plot = Path(args.out).with_suffix(".png")
    _plot(gamma_trace, dyn_arrivals, plot)
    real = run_real(args, profile) if getattr(args, "real", False) else None
    return {"label": "simulated target worker on a measured cost model (not a real-model run)",
            "cost_model": str(profile_path), "acceptance_alphas": [round(a, 3) for a in alphas],
            "max_gamma": MAX_GAMMA, "max_batch": MAX_BATCH, "requests": n, "seeds": seeds,
            "capacity_requests_per_s": round(capacity, 3), "mean_output_tokens": round(mean_out, 1),
            "dynamic_rate_fractions": {"base": DYNAMIC_LOW, "peak": DYNAMIC_PEAK},
            "dynamic": dynamic, "static": static, "summary": summary, "plot": str(plot),
            "offload": "measured separately on real models: `starjar bench offload`",
            "real": real}


def _plot(trace, arrivals, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from starjar.metrics import batch_bucket

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    buckets = sorted({batch_bucket(b) for _, b, _ in trace}, key=lambda s: int(s.split("-")[0].rstrip("+")))
    for bk in buckets:
        pts = [(t, g) for t, b, g in trace if batch_bucket(b) == bk]
        top.scatter([t for t, _ in pts], [g for _, g in pts], s=2, label=f"batch {bk}")
    top.set(ylabel="gamma chosen", title="Nightjar: gamma over time by batch size (dynamic trace, simulated)")
    top.legend(markerscale=5, fontsize=7, ncol=4)
    bottom.hist(arrivals, bins=60)
    bottom.set(xlabel="seconds", ylabel="arrivals per bin")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- real-model runs (a subset: they take minutes each on 2 cores) ------------------------------------

REAL_POLICIES = ["none", "nightjar", "fixed_1", "fixed_2", "dsd", "banditspec"]  # none first: the reference


def _real_run(target, draft, policy_name, profile, prompts, outs, arrivals, max_batch) -> dict:
    import time

    from controller.colocated import colocated_engine
    from starjar.sampling import SamplingParams

    policy = make_policy(policy_name, MAX_GAMMA, CSwitchTable.from_dict(profile["cswitch"]), profile, seed=0)
    engine = colocated_engine(target, draft, MAX_GAMMA, max_batch, policy=policy)
    reqs, i, t0 = [], 0, time.perf_counter()
    while i < len(prompts) or engine.has_work():
        now = time.perf_counter() - t0
        while i < len(prompts) and arrivals[i] <= now:
            reqs.append(engine.add_request(prompts[i], SamplingParams(max_tokens=outs[i], ignore_eos=True)))
            i += 1
        if engine.has_work():
            engine.step()
        else:
            time.sleep(max(0.0, arrivals[i] - now))
    tokens = sum(len(r.output_ids) for r in reqs)
    span = max(r.finish_s for r in reqs) - t0
    return {"tokens_per_s": round(tokens / span, 3),
            "mean_e2e_s": round(sum(r.finish_s - r.arrival_s for r in reqs) / len(reqs), 3),
            "outputs": [r.output_ids for r in reqs]}


def run_real(args, profile: dict) -> dict:
    """Greedy runs of the real default pair (co-located) at a low Poisson rate and with every request queued at
    once; outputs compared across policies (all must equal the target alone's)."""
    from benchmarks.common import pair_dirs
    from controller.colocated import load_pair
    from starjar.text import encode_prompt
    from starjar.workloads import spec_bench_mix

    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_pair(target_dir, draft_dir)
    n = 12 if args.quick else 32
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in spec_bench_mix(n)]
    _, trace_outs, _ = _trace(n)
    outs = [min(64, o) for o in trace_outs]
    loads = {"low (0.3 req/s)": poisson_arrivals(0.3, n, seed=3), "flood (all at t=0)": [0.0] * n}
    cost, alpha = CostModel(profile), sum(_alphas()) / len(_alphas())
    out = {"label": "real models, co-located, greedy", "pair": {"target": target_dir, "draft": draft_dir,
                                                                "note": note},
           "requests": n, "max_batch": 8}
    bar = tqdm(total=len(loads) * len(REAL_POLICIES), desc="nightjar bench (real)", file=sys.stderr)
    for label, arrivals in loads.items():
        table, ref = {}, None
        for name in REAL_POLICIES:
            res = _real_run(target, draft, name, profile, prompts, outs, arrivals, 8)
            outputs = res.pop("outputs")
            ref = ref if ref is not None else outputs  # "none" is the target alone
            res["identical_to_target_alone"] = outputs == ref
            # The simulator on the same requests, to show how far its figures can be trusted.
            sim = simulate(make_policy(name, MAX_GAMMA, CSwitchTable.from_dict(profile["cswitch"]), profile,
                                       seed=0), [SimRequest(a, o, alpha, len(p)) for a, o, p in
                                                 zip(arrivals, outs, prompts)], cost, 8)
            res["simulated"] = {"tokens_per_s": round(sim.tokens_per_s, 3), "mean_e2e_s": round(sim.mean_e2e_s, 3)}
            table[name] = res
            bar.update()
        out[label] = table
    bar.close()
    return out
