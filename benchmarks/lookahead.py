"""`starjar bench lookahead`: the draft server drafting ahead (`--lookahead chain`) against not (`off`);
with `--lookahead fanout` a third server drafting for likely rejections too, against both.

One target, batch 1 (`--batch-size`), greedy, the same prompts; two `starjar serve draft` processes on
loopback, one per mode, and the target alone (no drafts), alternated twice so drift on the machine hits all
alike. Reports tokens/s of each, and decode tokens/s (the target's prefill, the same in every mode, left out),
their ratios (chain over off, each over the target alone), the
chain server's hit rate (hits / (hits + misses)) and tokens drafted ahead and wasted, and whether the
outputs are identical. On a machine where the draft server shares the target's cores, lookahead competes
with verification for them: the ratio then measures that too; `--pin` gives the draft servers the last core
and the target the others (one torch thread), as where the draft has hardware of its own.
"""

from __future__ import annotations

import time

import grpc

from benchmarks.common import p50, pair_dirs, prompt_ids
from benchmarks.launch import start_draft_servers
from controller.colocated import colocated_engine, load_pair, remote_engine
from starjar.errors import InvalidArgument
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc

MODES = ("off", "chain")


def _ahead_figures(before: pb.DraftStats, after: pb.DraftStats) -> dict:
    """A lookahead server's hits, misses, hit rate and tokens drafted ahead and wasted over the timed runs."""
    d = {k: getattr(after, k) - getattr(before, k) for k in ("lookahead_hits", "lookahead_misses",
                                                             "lookahead_branch_hits", "lookahead_drafted_tokens",
                                                             "lookahead_wasted_tokens")}
    hits, misses = d["lookahead_hits"], d["lookahead_misses"]
    return {**d, "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}


def _timed(engine, prompts, params) -> tuple[list, float, float]:
    """(requests, tokens/s, decode tokens/s): the second leaves the target's prefill out, the same in every
    mode, so it is what drafting (ahead or not) can change."""
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    wall, tokens = time.perf_counter() - t0, sum(len(r.output_ids) for r in reqs)
    return reqs, tokens / wall, tokens / (wall - engine.stats.prefill_s)


def _stats(address: str) -> pb.DraftStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)


def run(args) -> dict:
    n_prompts, max_new = (4, 32) if args.quick else (12, 64)
    gamma = args.gamma or 3
    batch = 1 if getattr(args, "batch_size", None) is None else args.batch_size
    if batch < 1:
        raise InvalidArgument("--batch-size", "must be at least 1", batch)
    target_dir, draft_dir, note = pair_dirs(args)
    device = getattr(args, "device", "cpu")
    target, _ = load_pair(target_dir, draft_dir, device)
    prompts = prompt_ids(target.tokenizer, n_prompts, args)
    params = SamplingParams(max_tokens=max_new)
    modes = MODES + (("fanout",) if getattr(args, "lookahead", "off") == "fanout" else ())
    servers = start_draft_servers(draft_dir, modes, args.draft_threads, getattr(args, "pin", False), device)
    ways = ("alone", *modes)  # alone: the target with no drafts, on the same cores and threads
    ahead = modes[1:]

    def engine(way: str):
        if way == "alone":
            return colocated_engine(target, None, 0, batch)
        return remote_engine(target, servers[way].address, gamma, batch, deadline_s=5.0)

    try:
        for way in ways:  # warm-up: each server's first rounds (and the target's) are not timed
            eng = engine(way)
            eng.generate(prompts[:1], SamplingParams(max_tokens=8))
            if eng.proposer is not None:
                eng.proposer.close()
        before = {m: _stats(servers[m].address) for m in ahead}
        rates, decode, outs, rounds, phases = ({w: [] for w in ways}, {w: [] for w in ways}, {},
                                               {m: [] for m in modes}, {w: {} for w in ways})
        for _rep in range(2):
            for way in ways:
                eng = engine(way)
                reqs, rate, decode_rate = _timed(eng, prompts, params)
                for k in ("prefill_s", "propose_s", "verify_s"):
                    phases[way][k] = phases[way].get(k, 0.0) + getattr(eng.stats, k)
                if way != "alone":
                    eng.proposer.close()
                    cs = eng.proposer.stats
                    rounds[way] += [(r, q, c) for r, q, c in zip(cs.round_s, cs.server_queue_s, cs.server_compute_s,
                                                                  strict=True)]
                rates[way].append(rate)
                decode[way].append(decode_rate)
                outs[way] = [r.output_ids for r in reqs]
        figures = {m: _ahead_figures(before[m], _stats(servers[m].address)) for m in ahead}
    finally:
        for s in servers.values():
            s.kill()
    mean = {w: sum(rates[w]) / len(rates[w]) for w in ways}
    d_mean = {w: sum(decode[w]) / len(decode[w]) for w in ways}
    alone, off, chain = mean["alone"], mean["off"], mean["chain"]
    d_alone, d_off, d_chain = d_mean["alone"], d_mean["off"], d_mean["chain"]
    out = {"pair": {"target": target_dir, "draft": draft_dir, "note": note},
            "workload": {"prompts": n_prompts, "max_new_tokens": max_new, "gamma": gamma, "batch_size": batch,
                         "chat_template": bool(getattr(args, "chat", False)),
                         "output_tokens": sum(len(o) for o in outs["alone"]),
                         "draft_threads": args.draft_threads, "pinned": getattr(args, "pin", False),
                         "device": device},
            "off_tokens_per_s": round(off, 3), "chain_tokens_per_s": round(chain, 3),
            "ratio": round(chain / off, 4), "alone_tokens_per_s": round(alone, 3),
            "chain_over_alone": round(chain / alone, 4), "off_over_alone": round(off / alone, 4),
            "runs_tokens_per_s": {w: [round(r, 3) for r in rates[w]] for w in ways},
            # The same with the target's prefill left out (identical in every mode): the decoding drafts speed.
            "decode_tokens_per_s": {w: round(d_mean[w], 3) for w in ways},
            "decode_ratio": round(d_chain / d_off, 4), "decode_chain_over_alone": round(d_chain / d_alone, 4),
            "decode_off_over_alone": round(d_off / d_alone, 4),
            "runs_decode_tokens_per_s": {w: [round(r, 3) for r in decode[w]] for w in ways},
            **{k: v for k, v in figures["chain"].items() if k != "lookahead_branch_hits"},
            "outputs_identical": all(outs[w] == outs["alone"] for w in ways),
            # Per round as the target saw it, p50 in ms: the whole round, the server's queue wait, its compute.
            "round_ms_p50": {m: [round(1000 * p50([x[i] for x in rounds[m]]), 3) for i in range(3)] for m in modes},
            "rounds": {m: len(rounds[m]) for m in modes},
            # The target's seconds in prefill, waiting for drafts and verifying (decoding, alone), both repetitions.
            "target_phases_s": {w: {k: round(v, 3) for k, v in phases[w].items()} for w in ways}}
    if "fanout" in modes:  # fanout against chain (what its branches add), and against off and the target alone
        fan, d_fan = mean["fanout"], d_mean["fanout"]
        out["fanout"] = {"tokens_per_s": round(fan, 3), "over_chain": round(fan / chain, 4),
                         "over_off": round(fan / off, 4), "over_alone": round(fan / alone, 4),
                         "decode_over_chain": round(d_fan / d_chain, 4), "decode_over_off": round(d_fan / d_off, 4),
                         "decode_over_alone": round(d_fan / d_alone, 4), **figures["fanout"]}
    return out
