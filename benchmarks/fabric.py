"""`starjar bench fabric`: how many draft servers N targets need, from a simulator checked against measurement.

1. Calibrate (benchmarks/fabric_costs.py), from nothing the validation measures: the draft engine's pass
   cost by batch size, its per-round bookkeeping and its prompt passes, timed in this process with one
   torch thread (what each draft server gets); the workload (each script's rounds) from a dry replay;
   Z = the replayed verification time + the wire time of the calibration run (benchmarks/star.py).
2. Measure: replay targets on 1 and 2 real draft servers (benchmarks/star_fleet.py), fifo and batched,
   N <= 8: system tokens/s and draft load.
3. Validate: simulate every measured (N, M) as the bench ran it (targets start together, stop after the
   run's duration), and report both (`validation`), with busy time and loop iterations per round beside.
4. Project (labeled a projection): N = 1 .. 1024 targets, one draft server against the fewest that keep
   90% of unsaturated throughput (`scale`), and that number for N = 1024 as Z/S varies (`m_needed`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.fabric_batched import for_targets
from benchmarks.fabric_costs import from_json as costs_from_json
from benchmarks.sims.fabric_sim import Hosts, StarModel, drafts_needed, n_full, service_s, simulate

HOSTS_NOTE = {"validation": "as measured: all M draft servers on this machine's cores, one torch thread each, "
                             "slowed by the measured contention of draft servers busy at once (Z = 0, one target each)",
              "scale": "a projection with one host (one device) per draft server: no contention between them"}
SCALE_NS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
Z_OVER_S = [0.5, 1, 2, 4, 8, 16]


def calibrate(costs: dict, mode: str, z_s: float, plain_step_s: float, per_server: int = 1) -> StarModel:
    """A StarModel of one mode from the measured costs and workload (benchmarks/fabric_costs.measure), each
    draft server on a host of its own. per_server: targets per draft server, for the batched workload."""
    c = costs_from_json(costs)
    scripts = c["scripts"] if mode == "fifo" else for_targets(c["batched_scripts"], per_server)
    rounds = [r for s in scripts for r in s]
    tau = sum(r.tokens for r in rounds) / max(1, len(rounds))
    return StarModel(z_s=z_s, tokens_per_round=tau, plain_step_s=plain_step_s, cost=c["step"], mode=mode,
                     prefill=c["prefill"], round_s=c["round_s"], scripts=scripts, catchup=c["catchup"],
                     catchup_width=c["catchup_width"])


def this_host(costs: dict, m: int) -> Hosts:
    """The replay bench's hosts: all M draft servers on this machine, one torch thread each, slowed by the
    measured contention of draft servers busy at once (benchmarks/fabric_contention.py)."""
    return Hosts(per_host=max(1, m), cores=os.cpu_count() or 1, threads=1,
                 contention=costs_from_json(costs)["slowdown"])


def _err(measured: float, simulated: float) -> float:
    return round((simulated - measured) / measured, 4) if measured else 0.0


def _sim_row(model: StarModel, n: int, m: int, duration_s: float) -> dict:
    sim = simulate(model, n, m, duration_s=duration_s, together=True)
    return {"system_tokens_per_s": round(sim["system_tokens_per_s"], 3), "draft_load": round(sim["draft_load"], 4),
            "rounds_per_s": round(sim["rounds"] / sim["wall_s"], 3),
            "tokens_per_round": round(sim["system_tokens_per_s"] * sim["wall_s"] / max(1, sim["rounds"]), 4),
            "busy_per_round_s": round(sim["busy_per_round_s"], 5),
            "passes_per_round": round(sim["passes_per_round"], 4), "rows_per_pass": round(sim["rows_per_pass"], 3)}


def validate(rows: list[dict], costs: dict, z_s: float, plain_step_s: float, duration_s: float) -> list[dict]:
    """Every measured row against the simulator run the way the bench ran: its M draft servers share this
    host (its cores and the measured contention), the batched workload drafted with as many targets per
    server as the row had."""
    out = []
    for r in rows:
        per_server = -(-r["n"] // r["m"])
        model = replace(calibrate(costs, r["mode"], z_s, plain_step_s, per_server), hosts=this_host(costs, r["m"]))
        sim = _sim_row(model, r["n"], r["m"], r.get("duration_s", duration_s))
        measured = {k: r[k] for k in ("system_tokens_per_s", "draft_load", "busy_per_round_s", "passes_per_round",
                                      "tokens_per_round")}
        measured["rounds_per_s"] = round(r["n"] / r["cycle_s"], 3)
        measured.update({k: r[k] for k in ("pass_s_per_round", "drafts_per_pass") if k in r})  # where busy goes
        # tokens/s = rounds/s (the schedule: what the model is about) x tokens per round (the drafts' acceptance)
        out.append({"n": r["n"], "m": r["m"], "mode": r["mode"], "measured": measured, "simulated": sim,
                    "error": {k: _err(r[k], sim[k]) for k in ("system_tokens_per_s", "draft_load")},
                    "error_parts": {k: _err(measured[k], sim[k]) for k in ("rounds_per_s", "tokens_per_round",
                                                                          "busy_per_round_s")}})
    return out


def admitted(model: StarModel) -> StarModel:
    """The model with N_max as the controller's admission sets it (StarSD 4.2: the largest N at which a
    speculating target still beats decoding alone; see controller/fleet/admission.py)."""
    from controller.fleet.admission import n_max

    return replace(model, n_max=max(1, n_max(model.z_s + model.wake_s, service_s(model), model.tokens_per_round,
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
    s = service_s(model)
    out = []
    for ratio in Z_OVER_S:
        # Z is mostly the target's verification pass, and so is a step without drafts: they grow together.
        z = ratio * s
        m = admitted(replace(model, z_s=z, plain_step_s=model.plain_step_s * z / model.z_s, n_max=64))
        out.append({"z_over_s": ratio, "n_targets": n, "n_full": n_full(m), "n_max": m.n_max,
                    "m_drafts": drafts_needed(m, n, cycles=40)})
    return out


def _table(result: dict) -> str:
    lines = ["validation (replay measured vs simulated; tokens/s = rounds/s x tokens/round, and busy s and loop "
             "iterations per round beside):",
             "mode     N  M  tok/s meas  tok/s sim   err   load meas  load sim   err | rounds/s err  tok/round err"
             " | busy/round meas  sim | iter/round meas  sim"]
    for v in result["validation"]:
        me, si, er, ep = v["measured"], v["simulated"], v["error"], v["error_parts"]
        lines.append(f"{v['mode']:<7} {v['n']:>2} {v['m']:>2} {me['system_tokens_per_s']:>11.1f} "
                     f"{si['system_tokens_per_s']:>10.1f} {er['system_tokens_per_s']:>+6.1%} "
                     f"{me['draft_load']:>10.3f} {si['draft_load']:>9.3f} {er['draft_load']:>+6.1%} | "
                     f"{ep['rounds_per_s']:>+12.1%} {ep['tokens_per_round']:>+13.1%} | "
                     f"{me['busy_per_round_s']:>15.3f} {si['busy_per_round_s']:>5.3f} | "
                     f"{me['passes_per_round']:>15.2f} {si['passes_per_round']:>5.2f}")
    lines += ["", f"hosts: validation {result['hosts']['validation']}; scale {result['hosts']['scale']}"]
    lines += ["", "scale (projection, one host per draft server):", "mode        N     M  tokens/s    draft load"]
    for r in result["scale"]:
        lines.append(f"{r['mode']:<7} {r['n_targets']:>5} {r['m_drafts']:>5} {r['system_tokens_per_s']:>9.1f} "
                     f"{r['draft_load']:>10.3f}" + ("   <- M needed" if r["m_drafts"] == r["m_needed"] else ""))
    lines += ["", "draft servers for 1024 targets as Z/S grows (fifo):", "Z/S  N_full  M"]
    lines += [f"{r['z_over_s']:>4} {r['n_full']:>6} {r['m_drafts']:>4}" for r in result["m_needed"]]
    return "\n".join(lines)


def _measure(args, prep: dict) -> tuple[list[dict], float, dict]:
    """Replay rows (fifo and batched, M = 1 and 2), the replayed verification time, and the pair."""
    from benchmarks.star_fleet import sweep

    ns = [1, 4, 8] if args.quick else [1, 2, 4, 8]
    rows = []
    for mode in ("fifo", "batched"):
        for m in (1, 2):
            rows += sweep(prep["draft_dir"], mode, m, ns, prep["scripts"], prep["verify_s"], _duration(args),
                          prep["fingerprint"], on_row=lambda r: print(f"measured {r}", file=sys.stderr))
    return rows, prep["verify_s"], {"target": prep["target_dir"], "draft": prep["draft_dir"], "note": prep["note"]}


def _duration(args) -> float:
    return 6.0 if args.quick else 12.0


def _earlier(path: str) -> tuple[list[dict], float, dict]:
    """The same from an earlier `bench star --replay --draft-servers M` JSON (its fifo rows)."""
    import json

    star = json.loads(Path(path).read_text())
    ran = 6.0 if star["meta"].get("quick") else 15.0  # bench star's durations (rows from before they said)
    # Rows of one server with more threads (bench star's second comparison) are not what the model describes.
    rows = [{"duration_s": ran, **r} for r in star["rows"] if r.get("threads", 1) == 1]
    return rows, star["verify_s"], {**star["pair"], "measured_in": path, "measured_meta": star["meta"]}


def _calibration(prep: dict, z_s: float) -> dict:
    from benchmarks.fabric_costs import measure
    from benchmarks.replay_targets import GAMMA

    print("measuring the draft's pass costs, the replay workloads (single-row and batched) and the contention "
          "of two draft servers busy at once on this host ...", file=sys.stderr)
    return measure(prep["draft_dir"], prep["scripts"], GAMMA, z_s, prep["fingerprint"], threads=1)


def _series(result: dict, modes) -> dict:
    """The plot's lines: per mode, M = 1 and M = needed, system tokens/s by N."""
    out = {}
    for mode in modes:
        for label, keep in (("M = needed", lambda r: r["m_drafts"] == r["m_needed"]),
                            ("M = 1", lambda r: r["m_drafts"] == 1)):
            rs = [r for r in result["scale"] if r["mode"] == mode and keep(r)]
            out[f"{mode}, {label}"] = ([r["n_targets"] for r in rs], [r["system_tokens_per_s"] for r in rs])
    return out


def run(args) -> dict:
    from benchmarks.common import save_plot
    from benchmarks.star import prepare

    from_json = getattr(args, "from_json", None)
    prep = prepare(args)
    earlier = _earlier(from_json) if from_json else None
    verify_s = earlier[1] if earlier else prep["verify_s"]
    z = verify_s + prep["wire_s"]
    costs = _calibration(prep, z)  # before the rows: nothing in it comes from them
    rows, _, pair = earlier or _measure(args, prep)
    modes = sorted({r["mode"] for r in rows})
    # The projection: each draft server on a host (a device) of its own; the batched workload of the most
    # targets per server the calibration drafted with.
    models = {mode: calibrate(costs, mode, z, verify_s, per_server=SCALE_NS[-1]) for mode in modes}
    result = {"label": "validation: replay targets on real draft servers vs the simulator calibrated on the "
                       "draft's measured pass costs (not on these rows); scale and m_needed: a projection",
              "hosts": HOSTS_NOTE, "pair": pair,
              "calibration": {**costs, "z_s": z, "verify_s": verify_s, "wire_s": prep["wire_s"]},
              "models": {k: {"z_s": m.z_s, "tokens_per_round": m.tokens_per_round, "cost": m.cost.points,
                             "prefill": m.prefill.points, "catchup": m.catchup.points, "round_s": m.round_s,
                             "mode": m.mode} for k, m in models.items()},
              "measured": rows, "validation": validate(rows, costs, z, verify_s, _duration(args)),
              "scale": scale(models), "m_needed": m_needed(models["fifo"])}
    result["validation_max_error"] = max(abs(e) for v in result["validation"] for e in v["error"].values())
    print(_table(result))
    result["plot"] = save_plot(Path(args.out).with_suffix(".png"), "star fabric (simulated, calibrated by the "
                               "draft's pass costs)", _series(result, models), "targets N", "system tokens/s")
    return result
