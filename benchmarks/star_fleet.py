"""Replay targets over M draft servers (`starjar bench star --replay --draft-servers M`, and bench fabric).

M real draft server processes (one torch thread each by default: each draft
server stands for one device, so one core per draft server, the same for
M = 1, is the fair comparison of servers; bench star also reports one server
with M threads) serve N replay targets (see benchmarks/star.py). Each target is assigned with
the controller's own rules (controller/fleet/assignment.py). The servers
stay up across N; each row's load and pass costs come from the difference
of two GetStats snapshots around it. Labeled replay.
"""

from __future__ import annotations

import time

import grpc

from benchmarks.launch import ServerProcess
from benchmarks.replay_targets import GAMMA, run_replay_targets
from controller.fleet.assignment import Assignment, DraftSlot, place
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.remote.client import RemoteProposer


def _stats(address: str) -> pb.DraftStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)


def _quiet(address: str, limit_s: float = 3.0) -> pb.DraftStats:
    """GetStats once the server has stopped moving (the last releases are processed after targets end)."""
    stats, deadline = _stats(address), time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        time.sleep(0.1)
        again = _stats(address)
        if (again.busy_s, again.rounds) == (stats.busy_s, stats.rounds):
            return again
        stats = again
    return stats


def assign_targets(n: int, servers: list[str], fingerprint: str) -> list[str]:
    """Each target's server, as the controller would choose it (all live, N_max 64 each)."""
    slots = [DraftSlot(a, fingerprint, 64, live=True) for a in servers]
    a = Assignment({f"target-{k:03d}": None for k in range(n)})
    place(slots, a, {t: fingerprint for t in a.of})
    return [a.of[t] for t in sorted(a.of)]


def _delta(before: pb.DraftStats, after: pb.DraftStats) -> dict:
    rounds = after.rounds - before.rounds
    return {"busy_s": after.busy_s - before.busy_s, "rounds": rounds, "batches": after.batches - before.batches,
            # Where the busy time goes: forward passes (as the engine times them) and the drafts they made.
            "pass_s": after.mean_step_s * after.draft_steps - before.mean_step_s * before.draft_steps,
            "passes": after.draft_steps - before.draft_steps, "drafted": after.drafted_tokens - before.drafted_tokens,
            "service_s": (after.mean_service_s * after.rounds - before.mean_service_s * before.rounds)
            / max(1, rounds)}


def run_row(servers: list[str], n: int, scripts, verify_s: float, duration_s: float, fingerprint: str) -> dict:
    """N replay targets, one request at a time each, on `servers` for `duration_s`; one row of results."""
    where = assign_targets(n, servers, fingerprint)
    before = {a: _quiet(a) for a in servers}
    proposers = [RemoteProposer(where[k], fingerprint, f"target-{k}", deadline_s=30.0) for k in range(n)]
    try:
        targets, wall = run_replay_targets(proposers, scripts, verify_s, duration_s)
    finally:
        for p in proposers:
            p.close()
    per = {a: _delta(before[a], _quiet(a)) for a in servers}
    tokens = sum(t.stats.tokens for t in targets)
    rounds = sum(t.stats.rounds for t in targets)
    return {"n": n, "m": len(servers), "duration_s": duration_s, "system_tokens_per_s": round(tokens / wall, 3),
            # Over all M servers (as the simulator reports it): with N < M some stay idle.
            "draft_load": round(sum(min(1.0, per[a]["busy_s"] / wall) for a in servers) / len(servers), 4),
            "loads": [round(min(1.0, per[a]["busy_s"] / wall), 4) for a in servers],
            "targets_per_server": [where.count(a) for a in servers],
            "tokens_per_round": round(tokens / max(1, rounds), 4),
            "cycle_s": round(wall * n / max(1, rounds), 5),  # one target's mean round trip
            "busy_per_round_s": round(sum(p["busy_s"] for p in per.values()) /
                                      max(1, sum(p["rounds"] for p in per.values())), 5),
            "passes_per_round": round(sum(p["batches"] for p in per.values()) /
                                      max(1, sum(p["rounds"] for p in per.values())), 4),
            "pass_s_per_round": round(_over(per, "pass_s", "rounds"), 5),
            "pass_s_per_pass": round(_over(per, "pass_s", "passes"), 5),
            "drafts_per_pass": round(_over(per, "drafted", "passes"), 3),  # rows drafting in a pass, on average
            "fallbacks": sum(t.stats.fallbacks for t in targets)}


def _over(per: dict, num: str, den: str) -> float:
    return sum(p[num] for p in per.values()) / max(1, sum(p[den] for p in per.values()))


def sweep(draft_dir: str, mode: str, m: int, ns: list[int], scripts, verify_s: float, duration_s: float,
          fingerprint: str, on_row=None, threads: int = 1) -> list[dict]:
    """Rows for N in ns on M draft servers started once (fifo or batched), `threads` torch threads each."""
    procs = [ServerProcess("draft", "--model", draft_dir, "--port", "0", "--mode", mode, "--max-targets", "64",
                           threads=threads) for _ in range(m)]
    try:
        rows = []
        for n in ns:
            rows.append({"mode": mode, **run_row([p.address for p in procs], n, scripts, verify_s, duration_s,
                                                 fingerprint)})
            if on_row:
                on_row(rows[-1])
        return rows
    finally:
        for p in procs:
            p.kill()


def compare(prep: dict, m: int, ns: list[int], duration_s: float, plot_path, threads: int = 1) -> dict:
    """fifo, N in ns: M draft servers with `threads` torch threads each against one draft server with as many
    threads (the fair model: each draft server stands for one device of its own) and against one with M times
    as many (all the cores the M servers have together), same targets, scripts and Z. Each row notes its
    threads and the load average before and after it."""
    import os
    import sys

    from tqdm import tqdm

    from benchmarks.common import save_plot

    configs = [("m1", 1, threads), (f"m1_threads{m * threads}", 1, m * threads), (f"m{m}", m, threads)]
    bar = tqdm(total=len(configs) * len(ns), desc=f"star, 1 vs {m} draft servers (replay)", file=sys.stderr)

    def tick(row):
        bar.set_postfix(m=row["m"], n=row["n"], sys_tok_s=row["system_tokens_per_s"], load=row["draft_load"])
        bar.update()

    rows = {}
    for name, k, th in configs:
        load0 = os.getloadavg()[0]
        rows[name] = sweep(prep["draft_dir"], "fifo", k, ns, prep["scripts"], prep["verify_s"], duration_s,
                           prep["fingerprint"], tick, th)
        for r in rows[name]:
            r["threads"] = th
        rows[name][0]["load_average_1m_before"] = round(load0, 2)
        rows[name][-1]["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    bar.close()

    def ratio(over: str) -> dict:
        return {r1["n"]: round(rm["system_tokens_per_s"] / r1["system_tokens_per_s"], 3)
                for r1, rm in zip(rows[over], rows[f"m{m}"], strict=True)}

    same, all_cores = ratio("m1"), ratio(f"m1_threads{m * threads}")
    return {"label": "replay: recorded target continuations and a fixed verification time; draft servers real. "
                     f"M = {m} servers with {threads} torch thread(s) each against one server with {threads} "
                     f"(the fair model: a draft server stands for a device of its own) and against one with "
                     f"{m * threads} (every core the {m} servers have together)",
            "pair": {"target": prep["target_dir"], "draft": prep["draft_dir"], "note": prep["note"]},
            "mode": "fifo", "draft_threads": threads, "gamma": GAMMA, "verify_s": round(prep["verify_s"], 5),
            "service_time_s_fifo": round(prep["s_round"], 5), "draft_servers": m,
            "rows": [r for name, _, _ in configs for r in rows[name]],
            f"ratio_m{m}_over_m1": same, "ratio_at_max_n": same[max(ns)],
            f"ratio_m{m}_over_m1_threads{m * threads}": all_cores, "ratio_at_max_n_over_m1_all_threads":
                all_cores[max(ns)],
            "plot": save_plot(plot_path, f"star, 1 vs {m} draft servers (replay, fifo)",
                              {f"M = {k}, {th} thread(s) each": ([r["n"] for r in rows[name]],
                                                                 [r["system_tokens_per_s"] for r in rows[name]])
                               for name, k, th in configs}, "targets N", "system tokens/s")}
