"""`starjar bench star --replay`: StarSD's star scaling, batched vs fifo.

One real draft server process (the default pair's draft) serves N = 1..8
replay targets (threads in this process, each with its own gRPC stream): they
verify drafts against the target's recorded greedy continuations and spend a
fixed verification time Z per round, chosen so that StarSD's prediction
N_full = ceil(Z/S) + 1 lands near 4-5. Labeled replay: target compute is
simulated, the draft server, the wire and the scheduling are real.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
from tqdm import tqdm

from benchmarks.common import pair_dirs, prompt_ids, save_plot, target_continuations
from benchmarks.launch import ServerProcess
from benchmarks.replay_targets import GAMMA, run_replay_targets
from benchmarks.star_fleet import compare
from controller.fleet.admission import n_full
from starjar.errors import InvalidArgument
from starjar.model.loading import load_model
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.remote.client import RemoteProposer

VERIFY_OVER_S = 2.3


N_FULL_RULE = "smallest N at which the fifo draft server is fully busy (load >= 0.99), StarSD's N_full"


def n_full_measured(fifo_rows: list[dict]) -> int | None:
    return next((r["n_targets"] for r in fifo_rows if r["draft_load"] >= 0.99), None)


def _server_stats(address: str) -> pb.DraftStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)


def _settled_stats(address: str, limit_s: float = 3.0) -> pb.DraftStats:
    """GetStats once the server has gone quiet: the targets' last releases are still being processed when
    their threads end, and a sample taken meanwhile would not match a scrape taken a moment later."""
    stats, deadline = _server_stats(address), time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        time.sleep(0.1)
        again = _server_stats(address)
        if (again.busy_s, again.idle_s, again.rounds) == (stats.busy_s, stats.idle_s, stats.rounds):
            return again
        stats = again
    return stats


def _run_n(draft_dir, mode, n, scripts, verify_s, duration_s, fingerprint, lookahead: str = "off") -> dict:
    server = ServerProcess("draft", "--model", draft_dir, "--port", "0", "--mode", mode, "--max-targets", "64",
                           "--metrics-port", "0", "--lookahead", lookahead, threads=2)
    try:
        proposers = [RemoteProposer(server.address, fingerprint, f"target-{k}", deadline_s=30.0) for k in range(n)]
        targets, wall = run_replay_targets(proposers, scripts, verify_s, duration_s)
        stats = _settled_stats(server.address)
        exported = exported_draft_metrics(server.ready["metrics"])
        wire = [w for p in proposers for w in p.stats.wire_overhead_s()]
        for p in proposers:
            p.close()
    finally:
        server.kill()
    tokens = [t.stats.tokens for t in targets]
    return {"n_targets": n, "system_tokens_per_s": round(sum(tokens) / wall, 3),
            "per_target_tokens_per_s": round(sum(tokens) / wall / n, 3),
            "t_s_ms": round(1000 * stats.mean_step_s, 3), "s_ms": round(1000 * stats.mean_service_s, 3),
            "t_wait_ms": round(1000 * stats.mean_wait_s, 3), "t_idle_ms": round(1000 * stats.mean_idle_s, 3),
            "r_q": round(stats.rounds_per_s, 3),
            "r_p": round(sum(t.rounds_per_s for t in stats.targets) / max(1, len(stats.targets)), 3),
            "draft_load": round(stats.load, 4), "batches": stats.batches, "rounds": stats.rounds,
            "acceptance_rate": round(sum(t.stats.accepted for t in targets) /
                                     max(1, sum(t.stats.drafted for t in targets)), 4),
            "wire_ms_mean": round(1000 * sum(wire) / max(1, len(wire)), 3),
            # The same quantities as Prometheus sees them (a scrape right after GetStats).
            "exported": exported}


def exported_draft_metrics(metrics_address: str) -> dict:
    """Load and T_idle from a scrape of the draft server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from starjar.service.metrics import scrape

    text = scrape(metrics_address)
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    busy, idle = values["starjar_draft_busy_time_seconds_total"], values["starjar_draft_idle_time_seconds_total"]
    gaps = values["starjar_draft_idle_gap_seconds_count"]
    return {"draft_load": round(values["starjar_draft_load_ratio"], 4),
            "draft_load_from_counters": round(busy / (busy + idle), 4) if busy + idle else 0.0,
            "t_idle_ms": round(1000 * values["starjar_draft_idle_gap_seconds_sum"] / gaps, 3) if gaps else 0.0}


LOOKAHEAD_NS = (1, 2, 4, 8)  # idle draft time (N = 1), some (N = 2-4), none (saturated, N = 8)


def _lookahead_vs_off(prep: dict, duration: float, lookahead: str) -> dict:
    """Batched, at each of LOOKAHEAD_NS: system tokens/s and the draft server's rounds/s (R_q) with lookahead
    over without (fanout: chain too), run in mirrored order (on, off, off, on) so that drift hits every mode
    alike; the means, each mode's ratio over off, and every run."""
    modes = [lookahead] + (["chain"] if lookahead == "fanout" else []) + ["off"]
    ratios = {}
    for n in LOOKAHEAD_NS:
        runs, rq = {m: [] for m in modes}, {m: [] for m in modes}
        for m in modes + modes[::-1]:
            row = _run_n(prep["draft_dir"], "batched", n, prep["scripts"], prep["verify_s"], duration,
                         prep["fingerprint"], m)
            runs[m].append(row["system_tokens_per_s"])
            rq[m].append(row["r_q"])  # the draft server's rounds per second (StarSD's R_q)
        mean = {m: sum(v) / len(v) for m, v in runs.items()}
        mean_rq = {m: sum(v) / len(v) for m, v in rq.items()}
        ratios[str(n)] = {"runs": runs, "r_q_runs": rq, **{m: round(v, 3) for m, v in mean.items()},
                          "ratio": round(mean[lookahead] / mean["off"], 4) if mean["off"] else None,
                          "r_q_ratio": round(mean_rq[lookahead] / mean_rq["off"], 4) if mean_rq["off"] else None}
        if lookahead == "fanout":
            ratios[str(n)]["chain_ratio"] = round(mean["chain"] / mean["off"], 4) if mean["off"] else None
    return ratios


def prepare(args) -> dict:
    """The pair, the scripts (prompts and the target's greedy continuations) and the calibrated Z."""
    target_dir, draft_dir, note = pair_dirs(args)
    target = load_model(target_dir)
    prompts = prompt_ids(target.tokenizer, 16, args)
    print("recording the target's greedy continuations ...", file=sys.stderr)
    conts = target_continuations(target, prompts, 48)  # short: a target goes through several per run
    scripts = list(zip(prompts, conts, strict=True))
    fingerprint = target.fingerprint
    del target

    # Calibrate: S from fifo at N = 1 with no verification time; Z = VERIFY_OVER_S * S puts StarSD's
    # N_full = ceil(Z/S) + 1 at 4 (S measured with idle gaps, at N = 1, runs a little longer), with a
    # margin: at N = 4 the queue must stay non-empty through the jitter of S on a shared 2-core machine.
    calib = _run_n(draft_dir, "fifo", 1, scripts, 0.0, 4.0, fingerprint)
    s_round = calib["s_ms"] / 1000
    return {"target_dir": target_dir, "draft_dir": draft_dir, "note": note, "scripts": scripts,
            "fingerprint": fingerprint, "s_round": s_round, "verify_s": VERIFY_OVER_S * s_round,
            "wire_s": calib["wire_ms_mean"] / 1000}  # the wire's share of a round trip (part of Z)


def run(args) -> dict:
    if not getattr(args, "replay", False):
        raise SystemExit("bench star runs replay targets only on this machine: pass --replay")
    quick = args.quick
    ns = [1, 2, 4, 6, 8] if quick else list(range(1, 9))
    duration = 6.0 if quick else 15.0
    threads = getattr(args, "draft_threads", 1)
    if not 1 <= threads <= 16:
        raise InvalidArgument("draft_threads", "1 to 16", threads)
    prep = prepare(args)
    if getattr(args, "draft_servers", 1) > 1:
        return compare(prep, args.draft_servers, [1, 4, 8] if quick else [1, 2, 4, 6, 8], duration,
                       Path(args.out).with_suffix(".png"), threads)
    target_dir, draft_dir, note = prep["target_dir"], prep["draft_dir"], prep["note"]
    scripts, fingerprint, s_round, verify_s = prep["scripts"], prep["fingerprint"], prep["s_round"], prep["verify_s"]
    modes = {}
    bar = tqdm(total=2 * len(ns), desc="star scaling (replay)", file=sys.stderr)
    for mode in ("batched", "fifo"):
        rows = []
        for n in ns:
            rows.append(_run_n(draft_dir, mode, n, scripts, verify_s, duration, fingerprint, args.lookahead))
            bar.set_postfix(mode=mode, n=n, sys_tok_s=rows[-1]["system_tokens_per_s"], load=rows[-1]["draft_load"])
            bar.update()
        modes[mode] = rows
    bar.close()
    fifo = modes["fifo"]
    # StarSD's S(d) is the service time of a busy draft server: the calibration's (fifo, Z = 0, never idle).
    # Served after idle gaps a round takes longer (fifo at N = 1, also reported): StarSD sees the same.
    s_busy, s_after_idle = s_round, fifo[0]["s_ms"] / 1000
    z = verify_s + fifo[0]["wire_ms_mean"] / 1000  # return time: verification + wire
    predicted = n_full(z, s_busy) if s_busy else None
    measured = n_full_measured(fifo)
    b = {r["n_targets"]: r for r in modes["batched"]}
    f = {r["n_targets"]: r for r in fifo}
    out = {"label": "replay: recorded target continuations and a fixed verification time; draft server real",
           "pair": {"target": target_dir, "draft": draft_dir, "note": note},
           "gamma": GAMMA, "verify_s": round(verify_s, 5), "return_time_z_s": round(z, 5),
           "service_time_s_fifo": round(s_busy, 5), "service_time_s_fifo_after_idle": round(s_after_idle, 5),
           "modes": modes,
           "n_full_measured": measured, "n_full_predicted": predicted,
           "n_full_rule": N_FULL_RULE,
           "batched_scaling_6_over_1": round(b[6]["system_tokens_per_s"] / b[1]["system_tokens_per_s"], 3)
           if 6 in b else None,
           "batched_vs_fifo_round_rate_at_8": round(b[8]["r_q"] / f[8]["r_q"], 3) if 8 in b else None}
    if args.lookahead != "off":
        out["lookahead_vs_off"] = _lookahead_vs_off(prep, duration, args.lookahead)
    plot = Path(args.out).with_suffix(".png")
    out["plot"] = save_plot(plot, "star scaling (replay targets)",
                            {m: ([r["n_targets"] for r in rows], [r["system_tokens_per_s"] for r in rows])
                             for m, rows in modes.items()}, "targets N", "system tokens/s")
    return out
