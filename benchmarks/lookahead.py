"""`starjar bench lookahead`: the draft server drafting ahead (`--lookahead chain`) against not (`off`).

One target, batch 1, greedy, the same prompts; two `starjar serve draft` processes on loopback, one per
mode, alternated twice so drift on the machine hits both alike. Reports tokens/s of each, their ratio, the
chain server's hit rate (hits / (hits + misses)) and tokens drafted ahead and wasted, and whether the
outputs are identical. On a machine where the draft server shares the target's cores, lookahead competes
with verification for them: the ratio then measures that too; `--pin` gives the draft servers the last core
and the target the others (one torch thread), as where the draft has hardware of its own.
"""

from __future__ import annotations

import os
import time

import grpc
import torch

from benchmarks.common import p50, pair_dirs, prompt_ids
from benchmarks.launch import ServerProcess
from controller.colocated import load_pair, remote_engine
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc

MODES = ("off", "chain")


def _timed(engine, prompts, params) -> tuple[list, float]:
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    return reqs, sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t0)


def _start_servers(draft_dir: str, threads: int, pin: bool, device: str = "cpu") -> dict[str, ServerProcess]:
    """One draft server per mode. pin: the servers on the last core and this process (the target, one torch
    thread) on the others: the draft on cores of its own, as on a machine with a draft device."""
    cores = sorted(os.sched_getaffinity(0))
    if pin:
        if len(cores) < 2:
            raise SystemExit("--pin needs two cores")
        torch.set_num_threads(1)
        os.sched_setaffinity(0, cores[-1:])  # the servers are started with this affinity and keep it
    servers: dict[str, ServerProcess] = {}
    try:
        for m in MODES:
            servers[m] = ServerProcess("draft", "--model", draft_dir, "--port", "0", "--lookahead", m,
                                       "--device", device, threads=threads)
        return servers
    except BaseException:  # one failed to start: stop those already running rather than leave them behind
        for server in servers.values():
            server.terminate()
        raise
    finally:
        for tid in os.listdir("/proc/self/task") if pin else ():  # every thread of this process: the target's
            try:
                os.sched_setaffinity(int(tid), cores[:-1])
            except ProcessLookupError:  # a thread that ended since the listing
                pass
        os.sched_setaffinity(0, cores[:-1] if pin else cores)


def _stats(address: str) -> pb.DraftStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)


def run(args) -> dict:
    n_prompts, max_new = (4, 32) if args.quick else (12, 64)
    gamma = args.gamma or 3
    target_dir, draft_dir, note = pair_dirs(args)
    device = getattr(args, "device", "cpu")
    target, _ = load_pair(target_dir, draft_dir, device)
    prompts = prompt_ids(target.tokenizer, n_prompts, args)
    params = SamplingParams(max_tokens=max_new)
    servers = _start_servers(draft_dir, args.draft_threads, getattr(args, "pin", False), device)
    try:
        for m in MODES:  # warm-up: each server's first rounds (and the target's) are not timed
            eng = remote_engine(target, servers[m].address, gamma, 1, deadline_s=5.0)
            eng.generate(prompts[:1], SamplingParams(max_tokens=8))
            eng.proposer.close()
        before = _stats(servers["chain"].address)
        rates, outs, rounds, phases = {m: [] for m in MODES}, {}, {m: [] for m in MODES}, {m: {} for m in MODES}
        for _rep in range(2):
            for m in MODES:
                eng = remote_engine(target, servers[m].address, gamma, 1, deadline_s=5.0)
                reqs, rate = _timed(eng, prompts, params)
                eng.proposer.close()
                cs = eng.proposer.stats
                for k in ("prefill_s", "propose_s", "verify_s"):
                    phases[m][k] = phases[m].get(k, 0.0) + getattr(eng.stats, k)
                rounds[m] += [(r, q, c) for r, q, c in zip(cs.round_s, cs.server_queue_s, cs.server_compute_s,
                                                            strict=True)]
                rates[m].append(rate)
                outs[m] = [r.output_ids for r in reqs]
        after = _stats(servers["chain"].address)
    finally:
        for s in servers.values():
            s.kill()
    hits = after.lookahead_hits - before.lookahead_hits
    misses = after.lookahead_misses - before.lookahead_misses
    off, chain = (sum(rates[m]) / len(rates[m]) for m in MODES)
    return {"pair": {"target": target_dir, "draft": draft_dir, "note": note},
            "workload": {"prompts": n_prompts, "max_new_tokens": max_new, "gamma": gamma, "batch_size": 1,
                         "draft_threads": args.draft_threads, "pinned": getattr(args, "pin", False),
                         "device": device},
            "off_tokens_per_s": round(off, 3), "chain_tokens_per_s": round(chain, 3),
            "ratio": round(chain / off, 4), "runs_tokens_per_s": {m: [round(r, 3) for r in rates[m]] for m in MODES},
            "lookahead_hits": hits, "lookahead_misses": misses,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
            "lookahead_drafted_tokens": after.lookahead_drafted_tokens - before.lookahead_drafted_tokens,
            "lookahead_wasted_tokens": after.lookahead_wasted_tokens - before.lookahead_wasted_tokens,
            "outputs_identical": outs["off"] == outs["chain"],
            # Per round as the target saw it, p50 in ms: the whole round, the server's queue wait, its compute.
            "round_ms_p50": {m: [round(1000 * p50([x[i] for x in rounds[m]]), 3) for i in range(3)] for m in MODES},
            "rounds": {m: len(rounds[m]) for m in MODES},
            # The target's seconds in prefill, waiting for drafts and verifying, both repetitions.
            "target_phases_s": {m: {k: round(v, 3) for k, v in phases[m].items()} for m in MODES}}
