"""`starjar bench fabric`: how many draft servers N targets need, from a simulator checked against measurement.

1. Measure: replay targets on 1 and 2 real draft servers (benchmarks/star_fleet.py), fifo and batched,
   N <= 8: system tokens/s and draft load.
2. Calibrate the simulator (benchmarks/fabric_sim.py) from the M = 1 rows only: the pass cost as a function
   of the rounds in a pass, the extra cost after an idle gap, the return time Z and the tokens per round.
3. Validate: simulate every measured (N, M), M = 2 included, and report both (`validation`).
4. Project (labeled a projection): N = 1 .. 1024 targets, one draft server against the fewest that keep
   90% of unsaturated throughput (`scale`), and that number for N = 1024 as Z/S varies (`m_needed`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.fabric_sim import PassCost, StarModel, drafts_needed, n_full, simulate

SCALE_NS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
Z_OVER_S = [0.5, 1, 2, 4, 8, 16]


def calibrate(rows: list[dict], mode: str, fifo_rows: list[dict], plain_step_s: float) -> StarModel:
    """A StarModel from the M = 1 rows of one mode (fifo rows give S, the idle penalty and Z)."""
    f1 = {r["n"]: r for r in fifo_rows if r["m"] == 1}
    busiest = max(f1.values(), key=lambda r: r["draft_load"])
    s_busy = busiest["busy_per_round_s"]  # a busy fifo server: one round after another
    wake = max(0.0, f1[1]["busy_per_round_s"] - s_busy)  # a round served after an idle gap costs more
    z = f1[1]["cycle_s"] - f1[1]["busy_per_round_s"]  # N = 1: a cycle is Z + S (nothing waits)
    tau = f1[1]["tokens_per_round"]
    points = [(1.0, s_busy)]
    if mode == "batched":
        g = busiest["passes_per_round"]  # draft passes one round needs (gamma, fewer at a sequence's end)
        for r in rows:
            if r["m"] == 1 and r["n"] > 1:
                b = g / r["passes_per_round"]  # rounds that share each pass
                points.append((b, r["busy_per_round_s"] * b))
    return StarModel(z_s=z, tokens_per_round=tau, plain_step_s=plain_step_s, cost=PassCost(points), mode=mode,
                     wake_s=wake)


def _err(measured: float, simulated: float) -> float:
    return round((simulated - measured) / measured, 4) if measured else 0.0


def shared_host_slowdown(rows: list[dict], mode: str, m: int) -> float:
    """How much slower each pass is when M draft servers share this machine's cores: busy time per round at
    the largest N with M servers over the same with one (1.0 where each has its own device)."""
    top = max(r["n"] for r in rows if r["mode"] == mode and r["m"] == m)
    one = next(r for r in rows if r["mode"] == mode and r["m"] == 1 and r["n"] == top)
    many = next(r for r in rows if r["mode"] == mode and r["m"] == m and r["n"] == top)
    return many["busy_per_round_s"] / one["busy_per_round_s"]


def _sim_row(model: StarModel, n: int, m: int) -> dict:
    sim = simulate(model, n, m, cycles=300)
    return {"system_tokens_per_s": round(sim["system_tokens_per_s"], 3), "draft_load": round(sim["draft_load"], 4)}


def validate(rows: list[dict], models: dict[str, StarModel]) -> list[dict]:
    """Every measured row against the simulator calibrated on M = 1 (`simulated`: each draft server on its own
    device). For M > 1 also `simulated_shared_host`: every pass slowed by the factor measured at the largest N
    (on a 2-core machine two draft servers share the cores; the other N are then out of sample)."""
    out = []
    for r in rows:
        model = models[r["mode"]]
        sim = _sim_row(model, r["n"], r["m"])
        row = {"n": r["n"], "m": r["m"], "mode": r["mode"],
               "measured": {"system_tokens_per_s": r["system_tokens_per_s"], "draft_load": r["draft_load"]},
               "simulated": sim, "error": {k: _err(row_v, sim[k]) for k, row_v in
                                           (("system_tokens_per_s", r["system_tokens_per_s"]),
                                            ("draft_load", r["draft_load"]))}}
        if r["m"] > 1:
            f = shared_host_slowdown(rows, r["mode"], r["m"])
            shared = _sim_row(replace(model, cost=PassCost([(b, c * f) for b, c in model.cost.points]),
                                      wake_s=model.wake_s * f), r["n"], r["m"])
            row["shared_host_slowdown"] = round(f, 3)
            row["simulated_shared_host"] = shared
            row["error_shared_host"] = {k: _err(row["measured"][k], shared[k]) for k in shared}
        out.append(row)
    return out


def admitted(model: StarModel) -> StarModel:
    """The model with N_max as the controller's admission sets it (StarSD 4.2: the largest N at which a
    speculating target still beats decoding alone; see controller/admission.py)."""
    from controller.admission import n_max

    s = model.cost(1)
    return replace(model, n_max=max(1, n_max(model.z_s + model.wake_s, s, model.tokens_per_round,
                                              1 / model.plain_step_s, cap=64)))


def scale(models: dict[str, StarModel]) -> list[dict]:
    """Each N with one draft server and with the fewest that keep 90% of unsaturated throughput; each draft
    server admits its N_max (past that, targets decode alone, as the controller would have them)."""
    out = []
    for mode, model in models.items():
        model = admitted(model)
        for n in SCALE_NS:
            cycles = 100 if n <= 64 else 40
            need = drafts_needed(model, n, cycles=cycles)
            for m in sorted({1, need}):
                sim = simulate(model, n, m, cycles=cycles)
                out.append({"mode": mode, "n_targets": n, "m_drafts": m, "m_needed": need, "n_max": model.n_max,
                            "system_tokens_per_s": round(sim["system_tokens_per_s"], 2),
                            "draft_load": round(sim["draft_load"], 4)})
    return out


def m_needed(model: StarModel, n: int = 1024) -> list[dict]:
    """Draft servers N targets need as the return time grows against the service time (fifo model)."""
    s = model.cost(1)
    out = []
    for ratio in Z_OVER_S:
        # Z is mostly the target's verification pass, and so is a step without drafts: they grow together.
        z = ratio * s
        m = admitted(StarModel(z_s=z, tokens_per_round=model.tokens_per_round,
                               plain_step_s=model.plain_step_s * z / model.z_s, cost=model.cost, mode=model.mode,
                               wake_s=model.wake_s))
        out.append({"z_over_s": ratio, "n_targets": n, "n_full": n_full(m), "n_max": m.n_max,
                    "m_drafts": drafts_needed(m, n, cycles=40)})
    return out


def _table(result: dict) -> str:
    lines = ["validation (replay measured vs simulated; M > 1 also with the shared-host slowdown):",
             "mode     N  M  tok/s meas  tok/s sim   err   load meas  load sim   err"
             " | shared: tok/s   err    load   err"]
    for v in result["validation"]:
        me, si, er = v["measured"], v["simulated"], v["error"]
        line = (f"{v['mode']:<7} {v['n']:>2} {v['m']:>2} {me['system_tokens_per_s']:>11.1f} "
                f"{si['system_tokens_per_s']:>10.1f} {er['system_tokens_per_s']:>+6.1%} {me['draft_load']:>10.3f} "
                f"{si['draft_load']:>9.3f} {er['draft_load']:>+6.1%}")
        if "simulated_shared_host" in v:
            sh, es = v["simulated_shared_host"], v["error_shared_host"]
            line += (f" | {sh['system_tokens_per_s']:>12.1f} {es['system_tokens_per_s']:>+6.1%} "
                     f"{sh['draft_load']:>6.3f} {es['draft_load']:>+6.1%}")
        lines.append(line)
    lines += ["", "scale (projection):", "mode        N     M  tokens/s    draft load"]
    for r in result["scale"]:
        lines.append(f"{r['mode']:<7} {r['n_targets']:>5} {r['m_drafts']:>5} {r['system_tokens_per_s']:>9.1f} "
                     f"{r['draft_load']:>10.3f}" + ("   <- M needed" if r["m_drafts"] == r["m_needed"] else ""))
    lines += ["", "draft servers for 1024 targets as Z/S grows (fifo):", "Z/S  N_full  M"]
    lines += [f"{r['z_over_s']:>4} {r['n_full']:>6} {r['m_drafts']:>4}" for r in result["m_needed"]]
    return "\n".join(lines)


def _measure(args) -> tuple[list[dict], float, dict]:
    """Replay rows (fifo and batched, M = 1 and 2), the replayed verification time, and the pair."""
    from benchmarks.star import prepare
    from benchmarks.star_fleet import sweep

    prep = prepare(args)
    ns = [1, 4, 8] if args.quick else [1, 2, 4, 8]
    duration = 6.0 if args.quick else 12.0
    rows = []
    for mode in ("fifo", "batched"):
        for m in (1, 2):
            rows += sweep(prep["draft_dir"], mode, m, ns, prep["scripts"], prep["verify_s"], duration,
                          prep["fingerprint"], on_row=lambda r: print(f"measured {r}", file=sys.stderr))
    return rows, prep["verify_s"], {"target": prep["target_dir"], "draft": prep["draft_dir"], "note": prep["note"]}


def _earlier(path: str) -> tuple[list[dict], float, dict]:
    """The same from an earlier `bench star --replay --draft-servers M` JSON (its fifo rows)."""
    import json

    star = json.loads(Path(path).read_text())
    return star["rows"], star["verify_s"], {**star["pair"], "measured_in": path, "measured_meta": star["meta"]}


def run(args) -> dict:
    from benchmarks.common import save_plot

    from_json = getattr(args, "from_json", None)
    rows, verify_s, pair = _earlier(from_json) if from_json else _measure(args)
    fifo = [r for r in rows if r["mode"] == "fifo"]
    modes = sorted({r["mode"] for r in rows})
    models = {mode: calibrate([r for r in rows if r["mode"] == mode], mode, fifo, verify_s) for mode in modes}
    result = {"label": "validation: replay targets on real draft servers vs the simulator calibrated on M = 1; "
                       "scale and m_needed: a projection by the simulator",
              "pair": pair,
              "models": {k: {**vars(m), "cost": m.cost.points} for k, m in models.items()},
              "measured": rows, "validation": validate(rows, models), "scale": scale(models),
              "m_needed": m_needed(models["fifo"])}
    result["validation_max_error"] = max(abs(e) for v in result["validation"] for e in v["error"].values())
    print(_table(result))
    series = {f"{mode}, M = needed": ([r["n_targets"] for r in result["scale"] if r["mode"] == mode
                                       and r["m_drafts"] == r["m_needed"]],
                                      [r["system_tokens_per_s"] for r in result["scale"] if r["mode"] == mode
                                       and r["m_drafts"] == r["m_needed"]]) for mode in models}
    series.update({f"{mode}, M = 1": ([r["n_targets"] for r in result["scale"] if r["mode"] == mode
                                       and r["m_drafts"] == 1],
                                      [r["system_tokens_per_s"] for r in result["scale"] if r["mode"] == mode
                                       and r["m_drafts"] == 1]) for mode in models})
    result["plot"] = save_plot(Path(args.out).with_suffix(".png"), "star fabric (simulated, calibrated by replay)",
                               series, "targets N", "system tokens/s")
    return result
