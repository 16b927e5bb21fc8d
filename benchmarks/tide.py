"""`starjar bench tide`: online draft adaptation (TIDE) under a workload that drifts across domains.

One `starjar serve draft` process and one target
engine (the default target, greedy, gamma 3) that drafts from it over loopback
gRPC, run twice in one invocation: without adaptation, then with `--adapt
--adapt-collect-from-start`. Each run goes through the same phases, one
prompt category each (translation -> qa -> math_reasoning ->
summarization; `--dataset spec-bench` gives 80 questions a category, so no
prompt repeats within a run; both runs see the same prompts in the same order), for a fixed time
each, keeping CONCURRENCY requests in flight.

The machine has 2 cores: the target gets one (torch threads 1 in this
process) and the draft server the other (OMP_NUM_THREADS=1), so the draft
server's idle time is its own core's, as on a separate device; training uses
only that time. Phases are PHASE_S_QUICK seconds with --quick, PHASE_S
otherwise.

The draft: not the default pair's int8 copy of the target. It agrees with the
target at 0.83-0.97 next-token (offline, 2026-11-23) and its misses are int8
rounding on near-ties, not the domain: a training cycle on its translation
traffic scored 0.61 against its 0.88 on held-out sequences, so the gate keeps
the serving draft (deployed anyway, held-out agreement would fall 0.83 ->
0.70). The run uses a layer-skip draft instead: the target's first
SKIP_LAYERS (12 of 30) decoder layers and its head, untrained, built here
once. Offline, training on one category's traffic lifts its held-out
agreement 0.04 -> 0.13 on translation and 0.09 -> 0.12 on math_reasoning.
What adaptation learns for it is what those
layers skip, from the traffic: TIDE's case (a small draft head trained on
serving-time hidden states). `--draft DIR` runs any other draft;
`--adapt-train name=value,...` passes trainer settings to the adapting
server. Whether any candidate can pay at all on this machine: `starjar bench
tide-oracle` (an offline upper bound).

Reported per run: tokens/s over the whole drift, mean acceptance (accepted /
proposed), the draft server's round latency p99 (queue wait + compute, its own
timings), and per phase the acceptance, tokens/s and recovery time: seconds
from the switch until the acceptance over the last WINDOW_S seconds is back
within 10% of the previous phase's last WINDOW_S seconds (None: not within the
phase). Outputs are compared between the two runs on every prompt both
finished, and with the target alone (HF generate) on the first prompt of each
domain.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import torch

from benchmarks.common import pair_dirs, save_plot
from benchmarks.fixtures.reference import hf_greedy
from benchmarks.launch import ServerProcess
from starjar.model.loading import load_model
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import RemoteProposer

DOMAINS = ("translation", "qa", "math_reasoning", "summarization")
GAMMA = 3
MAX_NEW = 64
PROMPT_CAP = 256  # prompt tokens kept (the first ones): long RAG and summarization prompts stay affordable
CONCURRENCY = 2
PHASE_S, PHASE_S_QUICK = 90.0, 30.0  # full: both runs in ~14 min (a shared lock)
WINDOW_S = 6.0  # acceptance is judged over this trailing window
BIN_S = 2.0  # the plot's time resolution
RECOVERED = 0.9  # "within 10%" of the pre-switch acceptance
SKIP_LAYERS = 12


def layer_skip_draft(target_dir: str, layers: int = SKIP_LAYERS) -> str:
    """The target truncated to its first `layers` decoder layers (its final norm and tied head kept),
    saved once beside the default pair."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from starjar.model.default_pair import models_home

    final = models_home() / f"{Path(target_dir).name}-first{layers}layers"
    if (final / "starjar.json").is_file():
        return str(final)
    model = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(target_dir, local_files_only=True).save_pretrained(tmp)
    (tmp / "starjar.json").write_text(json.dumps({"kind": "truncated-target", "layers": layers}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return str(final)


def domain_prompts(tokenizer, args=None) -> dict[str, list[list[int]]]:
    from benchmarks.common import prompt_texts

    out: dict[str, list[list[int]]] = {d: [] for d in DOMAINS}
    for p in prompt_texts(args, None, categories=set(DOMAINS)):
        out[p.category].append(list(tokenizer(p.text)["input_ids"])[:PROMPT_CAP])
    return out


def _drive(eng: TargetEngine, prompts: dict[str, list[list[int]]], phase_s: float) -> dict:
    """Run the phases; per decode step (time, phase, drafted, accepted, tokens) and each finished request's
    output by (domain, prompt index)."""
    steps, outputs = [], {}
    params = SamplingParams(max_tokens=MAX_NEW)
    live: dict[int, tuple] = {}  # id(request) -> (domain, prompt index, request)
    next_prompt = dict.fromkeys(DOMAINS, 0)
    t0 = time.perf_counter()
    for phase, domain in enumerate(DOMAINS):
        end = t0 + (phase + 1) * phase_s
        while time.perf_counter() < end:
            while len(live) < CONCURRENCY and next_prompt[domain] < len(prompts[domain]):
                k = next_prompt[domain]
                next_prompt[domain] += 1
                req = eng.add_request(prompts[domain][k], params)
                live[id(req)] = (domain, k, req)
            drafted, accepted = eng.stats.drafted_tokens, eng.stats.accepted_tokens
            out = eng.step()
            tokens = sum(len(o.new_token_ids) for o in out)
            steps.append((time.perf_counter() - t0, phase, eng.stats.drafted_tokens - drafted,
                          eng.stats.accepted_tokens - accepted, tokens))
            for o in out:
                if o.finished:
                    d, k, req = live.pop(id(o.request))
                    outputs[(d, k)] = list(req.output_ids)
    for _, _, req in live.values():  # the last phase's stragglers: not counted, not compared
        eng.abort(req)
    return {"steps": steps, "outputs": outputs, "wall_s": time.perf_counter() - t0}


def _draft_stats(address: str) -> pb.DraftStats:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)


def _run(draft_dir: str, target, prompts, phase_s: float, flags: list[str]) -> dict:
    server = ServerProcess("draft", "--model", draft_dir, "--port", "0", "--max-targets", "4", *flags, threads=1)
    try:
        rp = RemoteProposer(server.address, target.fingerprint, "tide-bench", deadline_s=5.0)
        if not rp.wait_attached(60):
            raise RuntimeError("the target could not attach to the draft server")
        eng = TargetEngine(target, rp, FixedGamma(GAMMA), EngineConfig(max_batch_size=CONCURRENCY))
        eng.generate([p[:32] for p in prompts["translation"][-2:]], SamplingParams(max_tokens=8))  # warm-up
        trace = _drive(eng, prompts, phase_s)
        stats = _draft_stats(server.address)
        server_round = [q + c for q, c in zip(rp.stats.server_queue_s, rp.stats.server_compute_s, strict=True)]
        rp.close()
    finally:
        server.kill()
    trace["round_ms_p99"] = round(1000 * _quantile(server_round, 0.99), 3)
    trace["target_seen_round_ms_p99"] = round(1000 * _quantile(list(rp.stats.round_s), 0.99), 3)
    trace["swaps"] = stats.tide_swaps
    trace["train_steps"] = stats.tide_train_steps
    trace["cycles"] = stats.tide_cycles
    trace["heldout_acceptance"] = round(stats.tide_heldout_acceptance, 4)
    trace["training_share"] = round(stats.tide_train_s / trace["wall_s"], 4)
    trace["draft_load"] = round(stats.load, 4)
    return trace


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _acceptance(steps: list[tuple], lo: float, hi: float) -> float | None:
    drafted = sum(s[2] for s in steps if lo <= s[0] < hi)
    return sum(s[3] for s in steps if lo <= s[0] < hi) / drafted if drafted else None


def _recovery_s(steps: list[tuple], switch_s: float, phase_s: float) -> float | None:
    """Seconds after a switch until the trailing-window acceptance is within 10% of the pre-switch one."""
    before = _acceptance(steps, switch_s - WINDOW_S, switch_s)
    if before is None:
        return None
    for s in steps:
        t = s[0]
        if t < switch_s + WINDOW_S:
            continue
        if t >= switch_s + phase_s:
            return None
        now = _acceptance(steps, t - WINDOW_S, t)
        if now is not None and now >= RECOVERED * before:
            return round(t - switch_s, 2)
    return None


def summarize(trace: dict, phase_s: float) -> dict:
    steps = trace["steps"]
    in_run = [s for s in steps if s[0] < len(DOMAINS) * phase_s]
    per_phase = []
    for i, domain in enumerate(DOMAINS):
        lo, hi = i * phase_s, (i + 1) * phase_s
        acc = _acceptance(steps, lo, hi)
        per_phase.append({"domain": domain, "acceptance": round(acc, 4) if acc is not None else None,
                          "tokens_per_s": round(sum(s[4] for s in steps if lo <= s[0] < hi) / phase_s, 3),
                          "recovery_s": _recovery_s(steps, lo, phase_s) if i else None})
    acc = _acceptance(in_run, 0.0, float("inf"))
    return {"tokens_per_s": round(sum(s[4] for s in in_run) / (len(DOMAINS) * phase_s), 3),
            "acceptance_mean": round(acc, 4) if acc is not None else None,
            "round_ms_p99": trace["round_ms_p99"], "target_seen_round_ms_p99": trace["target_seen_round_ms_p99"],
            "per_phase": per_phase, "requests_finished": len(trace["outputs"]), "draft_load": trace["draft_load"],
            "swaps": trace["swaps"], "train_steps": trace["train_steps"], "training_share": trace["training_share"],
            "training_cycles": trace["cycles"], "heldout_acceptance_last": trace["heldout_acceptance"]}


def _series(steps: list[tuple], total_s: float, col: int) -> tuple[list[float], list[float]]:
    """Per BIN_S bin: acceptance (col 3: accepted over drafted) or tokens/s (col 4)."""
    xs, ys = [], []
    t = 0.0
    while t < total_s:
        rows = [s for s in steps if t <= s[0] < t + BIN_S]
        if col == 3:
            drafted = sum(s[2] for s in rows)
            if drafted:
                xs.append(t + BIN_S / 2)
                ys.append(sum(s[3] for s in rows) / drafted)
        else:
            xs.append(t + BIN_S / 2)
            ys.append(sum(s[4] for s in rows) / BIN_S)
        t += BIN_S
    return xs, ys


def _identity(target, prompts, runs: dict) -> dict:
    """Outputs of the two runs on every prompt both finished, and the target alone on each domain's first."""
    a, b = runs["without"]["outputs"], runs["with_adaptation"]["outputs"]
    common = sorted(set(a) & set(b))
    alone = [(d, 0) for d in DOMAINS if (d, 0) in a]
    alone_equal = sum(hf_greedy(target, prompts[d][0], MAX_NEW) == a[(d, 0)] == b.get((d, 0), a[(d, 0)])
                      for d, _ in alone)
    return {"compared_between_runs": len(common), "identical_between_runs": sum(a[k] == b[k] for k in common),
            "compared_with_target_alone": len(alone), "identical_to_target_alone": alone_equal}


def run(args) -> dict:
    phase_s = PHASE_S_QUICK if args.quick else PHASE_S
    target_dir, draft_dir, note = pair_dirs(args)
    if not getattr(args, "draft", None):
        draft_dir = layer_skip_draft(target_dir)
        note = (f"the target's first {SKIP_LAYERS} layers and its head, untrained (a layer-skip draft): the default "
                "int8 draft left adaptation nothing to learn (see this module's docstring)")
    torch.set_num_threads(1)  # the target's core; the draft server has the other
    target = load_model(target_dir)
    prompts = domain_prompts(target.tokenizer, args)
    adapt = ["--adapt", "--adapt-collect-from-start"]
    if getattr(args, "adapt_train", ""):
        adapt += ["--adapt-train", args.adapt_train]
    runs = {}
    for name, flags in (("without", []), ("with_adaptation", adapt)):
        print(f"bench tide: {name}, {len(DOMAINS)} phases of {phase_s:g} s ...", file=sys.stderr)
        runs[name] = _run(draft_dir, target, prompts, phase_s, flags)
    total = len(DOMAINS) * phase_s
    out = {"label": "one target engine in this process (1 core) drafting over loopback gRPC from a "
                    "`starjar serve draft` process (1 core); default target; greedy, gamma 3",
           "pair": {"target": target_dir, "draft": draft_dir, "note": note},
           "domains": list(DOMAINS), "phase_s": phase_s, "max_new_tokens": MAX_NEW, "concurrency": CONCURRENCY,
           "prompt_cap_tokens": PROMPT_CAP, "draft_server_flags_with_adaptation": " ".join(adapt)}
    for name, trace in runs.items():
        out[name] = summarize(trace, phase_s)
    w, wo = out["with_adaptation"], out["without"]
    out["swaps"], out["training_share"] = w["swaps"], w["training_share"]
    out["tokens_per_s_ratio"] = round(w["tokens_per_s"] / wo["tokens_per_s"], 4) if wo["tokens_per_s"] else None
    out["round_ms_p99_ratio"] = round(w["round_ms_p99"] / wo["round_ms_p99"], 4) if wo["round_ms_p99"] else None
    out["outputs"] = _identity(target, prompts, runs)
    base = Path(args.out).with_suffix("")
    out["plots"] = [save_plot(Path(f"{base}-acceptance.png"), "draft acceptance over a domain-switching run",
                              {n: _series(t["steps"], total, 3) for n, t in runs.items()}, "seconds",
                              f"acceptance ({BIN_S:g} s bins; switch every {phase_s:g} s)"),
                    save_plot(Path(f"{base}-tokens.png"), "tokens/s over a domain-switching run",
                              {n: _series(t["steps"], total, 4) for n, t in runs.items()}, "seconds", "tokens/s")]
    return out
