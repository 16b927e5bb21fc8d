"""`starjar bench tax`: the distribution tax on the default pair.

Co-located (draft engine in the target's process) vs remote (a `starjar serve
draft` process on loopback, N = 1), same prompts, greedy, batch 1, in one run.
The wire overhead per round is the round time the target sees minus the
server's queue wait and compute; next to it, a bare grpc.aio bidirectional
echo of the same message size between two processes, the floor of Python gRPC:
back to back, and with the remote rounds' median draft time idle before each
round (the threads on the path have gone to sleep, as between real rounds). `--pin`: the draft server on the
last core and the target (one thread, co-located or remote) on the other, as where the draft has a device of
its own beside the one the co-located target runs on. Decode rates leave the target's prefill out. `--gamma`: the
drafts a round, the same both ways (default 2), so that each way can be compared at the gamma that suits it.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from benchmarks.common import p50, pair_dirs, prompt_ids
from benchmarks.echo import measure_echo, measure_idle_echo
from benchmarks.launch import ServerProcess, start_draft_servers
from controller.colocated import colocated_engine, load_pair, remote_engine
from starjar.errors import InvalidArgument
from starjar.spec.sampling import SamplingParams
from target_worker.stats import MAX_GAMMA

DEFAULT_GAMMA = 2


def _timed(engine, prompts, params, label):
    """(requests, tokens/s, decode tokens/s: the target's prefill, the same either way, left out)."""
    t0 = time.perf_counter()
    bar = tqdm(total=len(prompts), desc=label, file=sys.stderr)
    reqs = engine.generate(prompts, params, on_step=lambda outs: bar.update(sum(o.finished for o in outs)))
    bar.close()
    wall, tokens = time.perf_counter() - t0, sum(len(r.output_ids) for r in reqs)
    return reqs, tokens / wall, tokens / (wall - engine.stats.prefill_s)


def run(args) -> dict:
    n_prompts, max_new = (4, 32) if args.quick else (12, 64)
    gamma = DEFAULT_GAMMA if getattr(args, "gamma", None) is None else args.gamma
    if not 1 <= gamma <= MAX_GAMMA:
        raise InvalidArgument("--gamma", f"1 to {MAX_GAMMA} drafts a round", gamma)
    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_pair(target_dir, draft_dir)
    prompts = prompt_ids(target.tokenizer, n_prompts, args)
    params = SamplingParams(max_tokens=max_new)
    colocated_engine(target, draft, gamma, 1).generate(prompts[:1], SamplingParams(max_tokens=8))  # warm-up

    pin = getattr(args, "pin", False)  # the server on the last core, this process (1 thread) on the other
    server = start_draft_servers(draft_dir, (args.lookahead,), 1 if pin else 2, pin)[args.lookahead]
    try:
        # Alternate the two modes twice so drift on the machine hits both alike.
        co_rates, re_rates, co_out, re_out, wire, draft_s = [], [], None, None, [], []
        decode: dict[str, list[float]] = {"colocated": [], "remote": []}
        for rep in range(2):
            reqs, rate, dec = _timed(colocated_engine(target, draft, gamma, 1), prompts, params,
                                     f"co-located #{rep}")
            co_rates.append(rate)
            decode["colocated"].append(dec)
            co_out = [r.output_ids for r in reqs]
            eng = remote_engine(target, server.address, gamma, 1, deadline_s=5.0)
            reqs, rate, dec = _timed(eng, prompts, params, f"remote #{rep}")
            re_rates.append(rate)
            decode["remote"].append(dec)
            re_out = [r.output_ids for r in reqs]
            wire.extend(eng.proposer.stats.wire_overhead_s())
            cs = eng.proposer.stats
            draft_s.extend(q + c for q, c in zip(cs.server_queue_s, cs.server_compute_s, strict=True))
            eng.proposer.close()
    finally:
        server.kill()
    # The message a typical round sends: one sequence, a few new tokens, gamma.
    from starjar.v1 import draft_pb2 as pb

    msg = pb.SpeculateRequest(round_id=1000, sequences=[pb.SequenceRound(seq_id=7, start=300, tokens=[1234, 5678],
                                                                         gamma=gamma)])
    echo = ServerProcess(module="benchmarks.echo")
    try:
        echo_ms = measure_echo(echo.address, msg.ByteSize(), 500)
        idle_echo_ms = measure_idle_echo(echo.address, msg.ByteSize(), 60, p50(draft_s))
    finally:
        echo.kill()
    colocated, remote = sum(co_rates) / 2, sum(re_rates) / 2
    co_decode, re_decode = sum(decode["colocated"]) / 2, sum(decode["remote"]) / 2
    return {"pair": {"target": target_dir, "draft": draft_dir, "note": note},
            "workload": {"prompts": n_prompts, "max_new_tokens": max_new, "gamma": gamma, "batch_size": 1,
                         "lookahead": args.lookahead, "pinned": pin,
                         "chat_template": bool(getattr(args, "chat", False))},
            "colocated_tokens_per_s": round(colocated, 3), "remote_tokens_per_s": round(remote, 3),
            "ratio": round(remote / colocated, 4),
            "colocated_decode_tokens_per_s": round(co_decode, 3), "remote_decode_tokens_per_s": round(re_decode, 3),
            "decode_ratio": round(re_decode / co_decode, 4),
            "wire_overhead_ms_p50": round(1000 * p50(wire), 4), "echo_ms_p50": round(echo_ms, 4),
            "wire_vs_echo": round(1000 * p50(wire) / echo_ms, 3) if echo_ms else None,
            "echo_idle_ms_p50": round(idle_echo_ms, 4), "echo_idle_gap_ms": round(1000 * p50(draft_s), 3),
            "message_bytes": msg.ByteSize(), "rounds_measured": len(wire),
            "outputs_identical": co_out == re_out}
