"""`starjar bench faults`: what a hung draft server and an abusive client cost.

hung: a batch-1 run of tiny-pair prompts through a real `starjar serve draft` process, SIGSTOPped after the
first request, against the target alone: wall time ratio (the breaker's job is to keep it under 2x) and
output equality.
abusive: one client against a real draft server with a small KV budget: more targets than N_max, rounds of the
most sequences at the longest lengths the limits allow, on many streams at once. What it was refused and why,
and the server's RSS (sampled while it runs) against its KV budget.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from benchmarks.fixtures.tiny_models import make_tiny_model
from benchmarks.launch import ServerProcess
from starjar import workloads
from starjar.model.loading import kv_bytes_per_token, load_model
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        target = make_tiny_model(Path(tmp) / "target", "llama", seed=0, max_context=4096)
        draft = make_tiny_model(Path(tmp) / "draft", "llama", seed=0, layers=1, tokenizer_from=target,
                                max_context=4096)
        # The abusive run's draft has 8 layers, as real drafts have several: the cache grows one layer's
        # buffer at a time, so its transient over the budget is a layer's share (with 1 layer, half the cache).
        deep = make_tiny_model(Path(tmp) / "deep_draft", "llama", seed=0, layers=8, tokenizer_from=target,
                               max_context=4096)
        return {"hung": _hung(str(target), str(draft), 12 if args.quick else 30),
                "abusive": _abusive(str(target), str(deep), quick=args.quick)}


def _hung(target_dir: str, draft_dir: str, n: int) -> dict:
    target = load_model(target_dir)
    tok = target.tokenizer
    prompts = [tok(p.text)["input_ids"][:160] for p in workloads.load("own", n)]
    params = SamplingParams(max_tokens=48)
    alone = TargetEngine(target, None, FixedGamma(0), EngineConfig(max_batch_size=1))
    alone.generate(prompts[:2], params)  # warm-up
    t0 = time.perf_counter()
    ref = [r.output_ids for r in alone.generate(prompts, params)]
    alone_s = time.perf_counter() - t0
    server = ServerProcess("draft", "--model", draft_dir, "--port", "0")
    try:
        rp = RemoteProposer(server.address, target.fingerprint, "hung-bench", deadline_s=0.5)
        rp.wait_attached(30)
        eng = TargetEngine(target, rp, FixedGamma(3), EngineConfig(max_batch_size=1))
        t0 = time.perf_counter()
        outs = [r.output_ids for r in eng.generate(prompts[:1], params)]
        os.kill(server.proc.pid, signal.SIGSTOP)  # hung: TCP stays open, nothing answers
        outs += [r.output_ids for r in eng.generate(prompts[1:], params)]
        hung_s = time.perf_counter() - t0
        stats = rp.stats
        rp.close()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.kill()
    return {"prompts": n, "max_tokens": params.max_tokens, "target_alone_s": round(alone_s, 2),
            "hung_draft_s": round(hung_s, 2), "ratio": round(hung_s / alone_s, 3), "outputs_equal": outs == ref,
            "fallbacks": dict(stats.fallbacks), "breaker_opened": rp.breaker.opened}


def _rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def _abusive(target_dir: str, draft_dir: str, quick: bool, budget_tokens: int = 262144,
             per_target: int = 65536) -> dict:
    draft = load_model(draft_dir)
    n_max, max_len = 4, 4000
    budget_bytes = budget_tokens * kv_bytes_per_token(draft)
    server = ServerProcess("draft", "--model", draft_dir, "--port", "0", "--max-targets", str(n_max),
                           "--max-kv-tokens", str(budget_tokens), "--max-kv-tokens-per-target", str(per_target),
                           "--max-sequences-per-target", "64")
    pid = server.proc.pid
    vocab, tok_hash = draft.fingerprint.split(":", 1)
    fp = pb.ModelFingerprint(vocab_size=int(vocab), tokenizer_hash=tok_hash)
    ch = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.DraftServiceStub(ch)
    refused: dict[str, int] = {}
    resync = drafted = rounds = 0
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes(pid))
            time.sleep(0.02)

    try:
        # Baseline: the server warmed up by one small round, as a real target would leave it.
        tag = stub.Attach(pb.AttachRequest(worker_id="warm", fingerprint=fp)).tag
        warm = stub.Speculate(iter([pb.SpeculateRequest(round_id=1, sequences=[
            pb.SequenceRound(seq_id=1, start=0, tokens=[5, 6, 7], gamma=2)])]), metadata=(("starjar-tag", tag.hex()),))
        list(warm)
        time.sleep(0.3)
        baseline = _rss_bytes(pid)
        threading.Thread(target=sample, daemon=True).start()
        tags = []
        for k in range(n_max + 4):  # more targets than N_max
            try:
                tags.append(stub.Attach(pb.AttachRequest(worker_id=f"abuser{k}", fingerprint=fp)).tag)
            except grpc.RpcError as exc:
                reason = dict(exc.trailing_metadata() or ()).get("starjar-reason", exc.code().name)
                refused[reason] = refused.get(reason, 0) + 1
        results = []

        def hammer(tag: bytes, k: int):
            seqs = 24 if quick else 64
            reqs = [pb.SpeculateRequest(round_id=r + 1, sequences=[
                pb.SequenceRound(seq_id=s + 1, start=0, tokens=[5 + (s + i) % 300 for i in range(max_len)],
                                 gamma=16) for s in range(seqs)]) for r in range(2 if quick else 4)]
            try:
                for resp in stub.Speculate(iter(reqs), metadata=(("starjar-tag", tag.hex()),), timeout=600):
                    results.append(resp)
            except grpc.RpcError as exc:
                reason = dict(exc.trailing_metadata() or ()).get("starjar-reason", exc.code().name)
                refused[reason] = refused.get(reason, 0) + 1

        threads = [threading.Thread(target=hammer, args=(t, k)) for k, t in enumerate(tags)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for resp in results:
            rounds += 1
            for s in resp.sequences:
                resync += s.resync
                drafted += not s.resync
        time.sleep(0.3)
        stop.set()
        final = _rss_bytes(pid)
    finally:
        stop.set()
        ch.close()
        server.kill()
    growth = peak[0] - baseline
    return {"kv_budget_tokens": budget_tokens, "kv_budget_bytes": budget_bytes, "n_max": n_max,
            "attach_tries": n_max + 4, "refused": refused, "rounds_answered": rounds,
            "sequences_drafted": drafted, "sequences_answered_resync": resync,
            "kv_budget_tokens_per_target": per_target,
            "asked_tokens": len(tags) * (64 if not quick else 24) * max_len,
            "rss_baseline_bytes": baseline, "rss_peak_bytes": peak[0], "rss_final_bytes": final,
            "rss_growth_bytes": growth, "growth_over_budget": round(growth / budget_bytes, 3)}
