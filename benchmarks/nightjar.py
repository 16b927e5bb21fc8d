"""`starjar bench nightjar`: Nightjar against every baseline, on a dynamic trace and at static rates.

Simulated target worker (benchmarks/sims/nightjar_sim.py) on this machine's measured
cost model (`starjar profile` of the default pair, benchmarks/fixtures/
profile-default-pair.json unless --profile) and acceptance measured per
Spec-Bench category (benchmarks/fixtures/draft-default-pair.json). Arrivals:
the Azure conversation trace's inter-arrival gaps, time-rescaled to this
machine's capacity: half of capacity, with a middle third whose rate rises to
1.5x capacity and falls back (dynamic); and Poisson arrivals from 0.1x to 1.3x
capacity (static). (A base of 0.2x left the machine idle most of the time:
every policy's throughput was then the arrival rate, 47.08 +- 0.02 tok/s.) Output
lengths come from the trace (8 to 256 tokens), prompt lengths from starjar's own prompts.
The trace ships in benchmarks/fixtures/azure (its source and license are in the README there).
Capacity is what the target alone sustains when every request is queued at
once. Each figure is the mean over seeds.

Two devices. "dynamic"/"static": an emulated device whose KV pool is short, as
on a GPU: with the draft resident it holds a full batch of average requests,
and the draft's weights are worth N_draft more tokens. There serving without
speculation loads no draft, Nightjar offloads the draft with the engine's own
rule (ElasticRule) while it does not speculate, and every other policy keeps
the draft resident ("nightjar_no_offload" is Nightjar without the offload). "unlimited_kv": this machine as it is, where
memory never binds and only compute matters.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.sims.nightjar_sim import (
    CostModel,
    Memory,
    SimRequest,
    alpha_from_mean_accepted,
    poisson_arrivals,
    rise_and_fall,
    simulate,
    warp_trace,
)
from starjar import workloads
from starjar.spec.policies import make_policy
from starjar.spec.policies.nightjar import CSwitchTable
from target_worker.elastic_kv import T_PERSIST_STEPS, TAU_LOW_TOKENS, ElasticRule

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRACE = Path(__file__).resolve().parent / "fixtures" / "azure" / "AzureLLMInferenceTrace_conv.csv"
MAX_GAMMA = 4
MAX_BATCH = 16
DYNAMIC_LOW, DYNAMIC_PEAK = 0.5, 1.5  # fractions of capacity
STATIC_FRACTIONS = (0.1, 0.3, 0.6, 0.9, 1.3)
RELOAD_S = 0.006  # a draft reload on this machine (`starjar bench offload`)
POLICIES = ["nightjar", "nightjar_paper", "none"] + [f"fixed_{g}" for g in range(1, MAX_GAMMA + 1)] + \
    ["dsd", "banditspec", "tide", "vllm_table", "sglang_ema", "hf_heuristic"]


def _trace(n: int) -> tuple[list[float], list[int], list[int]]:
    with TRACE.open() as f:
        rows = list(csv.DictReader(f))[: n + 1]
    from datetime import datetime

    ts = [datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp() for r in rows]
    gaps = [max(1e-3, b - a) for a, b in zip(ts[:-1], ts[1:], strict=True)]
    outs = [min(256, max(8, int(r["GeneratedTokens"]))) for r in rows[:n]]
    # Prompt lengths are those of starjar's own prompts (chat template included: about 4 characters per token
    # plus 30 template tokens).
    texts = workloads.texts(workloads.load("own", 80))
    prompts = [30 + len(texts[k % len(texts)]) // 4 for k in range(n)]
    return gaps, outs, prompts


def _alphas() -> list[float]:
    d = json.loads((FIXTURES / "draft-default-pair.json").read_text())
    return [alpha_from_mean_accepted(v["mean_accepted_len"]) for v in d["acceptance_gamma3_by_category"].values()]


def _requests(arrivals, outs, prompts, alphas) -> list[SimRequest]:
    rows = enumerate(zip(arrivals, outs, prompts, strict=True))
    return [SimRequest(a, o, alphas[k % len(alphas)], p) for k, (a, o, p) in rows]


def _memory(name: str, device: dict | None) -> Memory | None:
    """The emulated device each policy runs on: serving without speculation loads no draft; Nightjar lends
    the draft's memory to the KV pool with the engine's own rule; everything else keeps the draft resident."""
    if device is None:
        return None
    if name == "none":
        return Memory(device["kv_tokens"], device["draft_tokens"], draft_loaded=False)
    elastic = ElasticRule(device["draft_tokens"]) if name == "nightjar" else None
    return Memory(device["kv_tokens"], device["draft_tokens"], elastic=elastic, reload_s=RELOAD_S)


def _run_all(requests, cost, profile, seeds, device=None, record=False) -> tuple[dict, list]:
    out, trace = {}, []
    names = POLICIES + (["nightjar_no_offload"] if device else [])
    for name in names:
        runs = []
        for s in seeds:
            policy = make_policy("nightjar" if name == "nightjar_no_offload" else name, MAX_GAMMA, cost.cswitch,
                                 profile, seed=s)
            runs.append(simulate(policy, requests, cost, MAX_BATCH, seed=s, record=record and name == "nightjar",
                                 memory=_memory(name, device)))
            if runs[-1].gammas and not trace:
                trace = runs[-1].gammas

        def mean(attr: str, runs=runs) -> float:
            return round(sum(getattr(r, attr) for r in runs) / len(runs), 3)

        out[name] = {"tokens_per_s": mean("tokens_per_s"), "mean_tpot_s": mean("mean_tpot_s"),
                     "mean_e2e_s": mean("mean_e2e_s"), "speculating_step_share": mean("spec_share")}
        if device:
            out[name].update(peak_running=max(r.peak_running for r in runs), preemptions=mean("preemptions"),
                             offloads=mean("offloads"))
    return out, trace


def _ratios(table: dict) -> dict:
    table = {k: v for k, v in table.items() if k != "load_fraction"}
    fixed = {k: v["tokens_per_s"] for k, v in table.items() if k.startswith("fixed_")}
    best_fixed = max(fixed, key=fixed.get)
    nj = table["nightjar"]["tokens_per_s"]
    out = {"best_fixed": best_fixed, "nightjar_over_best_fixed": round(nj / fixed[best_fixed], 3)}
    # The bar counts gamma 0 as a fixed gamma too: where speculation loses, "none" is the one to beat.
    fixed["none"] = table["none"]["tokens_per_s"]
    best_any = max(fixed, key=fixed.get)
    out.update(best_fixed_or_none=best_any, nightjar_over_best_fixed_or_none=round(nj / fixed[best_any], 3))
    for other in ("none", "dsd", "banditspec", "nightjar_no_offload"):
        if other in table:
            out[f"nightjar_over_{other}"] = round(nj / table[other]["tokens_per_s"], 3)
    out["best_overall"] = max(table, key=lambda k: table[k]["tokens_per_s"])
    return out


def _tables(device, gaps, outs, prompts, alphas, cost, profile, capacity, n, seeds, bar) -> dict:
    dyn_arrivals = warp_trace(gaps, rise_and_fall(n, DYNAMIC_LOW * capacity, DYNAMIC_PEAK * capacity))
    dynamic, gamma_trace = _run_all(_requests(dyn_arrivals, outs, prompts, alphas), cost, profile, seeds,
                                    device, record=True)
    bar.update()
    static = {}
    for frac in STATIC_FRACTIONS:
        rate = frac * capacity
        reqs = _requests(poisson_arrivals(rate, n, seed=7), outs, prompts, alphas)
        static[f"{rate:.3f}"] = dict(_run_all(reqs, cost, profile, seeds, device)[0], load_fraction=frac)
        bar.update()
    return {"dynamic": dynamic, "static": static, "gamma_trace": gamma_trace, "arrivals": dyn_arrivals,
            "summary": {"dynamic": _ratios(dynamic), "static": {r: _ratios(t) for r, t in static.items()}}}


def run(args) -> dict:
    profile_path = Path(getattr(args, "profile", None) or FIXTURES / "profile-default-pair.json")
    profile = json.loads(profile_path.read_text())
    cost = CostModel(profile)
    covered = cost.covers(MAX_BATCH, MAX_GAMMA)
    if not covered:
        print(f"note: {profile_path} was not measured up to batch {MAX_BATCH} and gamma {MAX_GAMMA}; steps past "
              "its grid are extrapolated linearly (a full `starjar profile` covers them)", file=sys.stderr)
    alphas = _alphas()
    n = 300 if args.quick else 1200
    seeds = [0, 1] if args.quick else [0, 1, 2]
    gaps, outs, prompts = _trace(n)
    mean_out = sum(outs) / len(outs)
    # Capacity: requests/s the target alone sustains, from a simulated run with every request queued at once.
    flood = _requests([0.0] * n, outs, prompts, alphas)
    capacity = simulate(make_policy("none"), flood, cost, MAX_BATCH).tokens_per_s / mean_out
    # The emulated device: with the draft resident, its KV pool holds a full batch of average requests (the
    # mildest pressure that still binds: long requests and draft lookahead overflow it).
    draft_tokens = math.ceil(profile["draft_weight_bytes"] / profile["kv_bytes_per_token"])
    full_batch = round(MAX_BATCH * (sum(outs) + sum(prompts)) / n)
    device = {"kv_tokens": full_batch, "draft_tokens": draft_tokens,
              "rule": "kv_tokens (draft resident) = max_batch x mean (prompt + output) tokens",
              "t_persist_steps": T_PERSIST_STEPS, "tau_low_tokens": TAU_LOW_TOKENS, "reload_s": RELOAD_S}

    bar = tqdm(total=2 * (1 + len(STATIC_FRACTIONS)), desc="nightjar bench (simulated)", file=sys.stderr)
    limited = _tables(device, gaps, outs, prompts, alphas, cost, profile, capacity, n, seeds, bar)
    unlimited = _tables(None, gaps, outs, prompts, alphas, cost, profile, capacity, n, seeds, bar)
    bar.close()
    plot = Path(args.out).with_suffix(".png")
    _plot(limited["gamma_trace"], limited["arrivals"], plot)
    real = run_real(args, profile) if getattr(args, "real", False) else None
    return {"label": "simulated target worker on a measured cost model (not a real-model run)",
            "cost_model": str(profile_path), "cost_model_covers_simulation": covered,
            "cost_model_grid": {k: profile["step_s"][k] for k in ("batch_sizes", "gammas")} if profile.get("step_s")
            else None,
            "acceptance_alphas": [round(a, 3) for a in alphas],
            "max_gamma": MAX_GAMMA, "max_batch": MAX_BATCH, "requests": n, "seeds": seeds,
            "capacity_requests_per_s": round(capacity, 3), "mean_output_tokens": round(mean_out, 1),
            "dynamic_rate_fractions": {"base": DYNAMIC_LOW, "peak": DYNAMIC_PEAK},
            "device": device,
            "dynamic": limited["dynamic"], "static": limited["static"], "summary": limited["summary"],
            "unlimited_kv": {k: unlimited[k] for k in ("dynamic", "static", "summary")},
            "plot": str(plot), "real": real}


def _plot(trace, arrivals, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from starjar.service.metrics import batch_bucket

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
    from starjar.spec.sampling import SamplingParams

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
    multi = [r for r in reqs if len(r.output_ids) > 1]
    tpot = sum((r.finish_s - r.first_token_s) / (len(r.output_ids) - 1) for r in multi) / max(1, len(multi))
    return {"tokens_per_s": round(tokens / span, 3), "mean_tpot_s": round(tpot, 4),
            "mean_e2e_s": round(sum(r.finish_s - r.arrival_s for r in reqs) / len(reqs), 3),
            "outputs": [r.output_ids for r in reqs]}


def run_real(args, profile: dict) -> dict:
    """Greedy runs of the real default pair (co-located) at a low Poisson rate and with every request queued at
    once; outputs compared across policies (all must equal the target alone's)."""
    from benchmarks.common import pair_dirs
    from controller.colocated import load_pair
    from starjar.model.text import encode_prompt

    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_pair(target_dir, draft_dir)
    n = 12 if args.quick else 32
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in workloads.texts(workloads.load("own", n))]
    _, trace_outs, _ = _trace(n)
    outs = [min(64, o) for o in trace_outs]
    loads = {"low (0.3 req/s)": poisson_arrivals(0.3, n, seed=3), "flood (all at t=0)": [0.0] * n}
    cost, alphas = CostModel(profile), _alphas()
    alpha = sum(alphas) / len(alphas)
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
            sim_requests = [SimRequest(a, o, alpha, len(p)) for a, o, p in zip(arrivals, outs, prompts, strict=True)]
            sim = simulate(make_policy(name, MAX_GAMMA, cost.cswitch, profile, seed=0), sim_requests, cost, 8)
            res["simulated"] = {"tokens_per_s": round(sim.tokens_per_s, 3), "mean_tpot_s": round(sim.mean_tpot_s, 4),
                                "mean_e2e_s": round(sim.mean_e2e_s, 3)}
            table[name] = res
            bar.update()
        out[label] = table
    bar.close()
    return out
