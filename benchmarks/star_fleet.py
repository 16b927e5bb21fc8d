"""Replay targets over M draft servers (`starjar bench star --replay --draft-servers M`, and bench fabric).

M real draft server processes (one torch thread each: one core per draft
server, the same for M = 1, so the comparison is of servers, not threads)
serve N replay targets (see benchmarks/star.py). Each target is assigned with
the controller's own rules (controller/draft_assignment.py). The servers
stay up across N; each row's load and pass costs come from the difference
of two GetStats snapshots around it. Labeled replay.
"""

from __future__ import annotations

import time

import grpc

from benchmarks.star import GAMMA, run_replay_targets
from controller.draft_assignment import Assignment, DraftSlot, place
from controller.launch import ServerProcess
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.draft_client import RemoteProposer


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
            "fallbacks": sum(t.stats.fallbacks for t in targets)}


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
    """fifo, N in ns: M draft servers against one, same targets, same scripts, same Z; `threads` torch threads
    per draft server (one each by default: one core per server, the same for M = 1)."""
    import sys

    from tqdm import tqdm

    from benchmarks.common import save_plot

    bar = tqdm(total=2 * len(ns), desc=f"star, 1 vs {m} draft servers (replay)", file=sys.stderr)

    def tick(row):
        bar.set_postfix(m=row["m"], n=row["n"], sys_tok_s=row["system_tokens_per_s"], load=row["draft_load"])
        bar.update()

    rows = {k: sweep(prep["draft_dir"], "fifo", k, ns, prep["scripts"], prep["verify_s"], duration_s,
                     prep["fingerprint"], tick, threads) for k in (1, m)}
    bar.close()
    ratio = {r1["n"]: round(rm["system_tokens_per_s"] / r1["system_tokens_per_s"], 3)
             for r1, rm in zip(rows[1], rows[m], strict=True)}
    return {"label": "replay: recorded target continuations and a fixed verification time; draft servers real "
                     f"({threads} torch thread(s) each)",
            "pair": {"target": prep["target_dir"], "draft": prep["draft_dir"], "note": prep["note"]},
            "mode": "fifo", "draft_threads": threads, "gamma": GAMMA, "verify_s": round(prep["verify_s"], 5),
            "service_time_s_fifo": round(prep["s_round"], 5), "draft_servers": m,
            "rows": rows[1] + rows[m], f"ratio_m{m}_over_m1": ratio, "ratio_at_max_n": ratio[max(ns)],
            "plot": save_plot(plot_path, f"star, 1 vs {m} draft servers (replay, fifo)",
                              {f"M = {k}": ([r["n"] for r in rows[k]], [r["system_tokens_per_s"] for r in rows[k]])
                               for k in rows}, "targets N", "system tokens/s")}
