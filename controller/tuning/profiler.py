"""`starjar profile`: the latency tables the planners load at start.

- C_switch(L_max, B) (Nightjar section 4.2): what a step costs extra when
  speculation resumes after L_max tokens without it, for B sequences: the
  draft must first catch up on those tokens. Measured on the draft engine as
  T_SD - T_base: a round that carries L_max new tokens per sequence minus a
  steady-state round (one new token per sequence), both proposing one token.
- T(n) and D0 (TIDE section 4.1): the target's decode step with n sequences,
  and one draft step at batch 1.
- step_s[B][gamma]: a whole co-located decode step (drafting, verifying and
  rolling back) with B sequences, measured rather than composed from T(n) and
  D0: at B > 1 the draft's small-batch passes cost more than the target's
  scaling suggests, and ragged contexts pad to the longest. The simulated
  benchmark uses it.

- verify_budget (AdaServe section 3): tokens per target pass at batch 1 while the pass stays within 1.25x
  of a one-token pass; the tree policies select at most this many tokens per step.

Output JSON: {"cswitch": {"lengths", "batch_sizes", "cost_s"}, "t_of_n": {n: s}, "d0_s": s,
"step_s": {"batch_sizes", "gammas", "seconds"}, "kv_bytes_per_token": B, "draft_weight_bytes": B, ...}.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

from tqdm import tqdm

from starjar.cpu.machine import machine_info
from starjar.spec.proposer import DraftRequest

CONTEXT = 64  # prompt tokens per profiled sequence
# The step grid's contexts: a batch as serving sees it, ragged. Sequence k of B is at the (k + 0.5)/B
# quantile of starjar's own prompt lengths (chat template) plus half of a mean Azure output (87 tokens).
# Padding to the longest makes a speculative step at B=8 cost 146 ms with contexts 64..512 against 105 ms
# with all at 256 (same mean); a plain step 56 vs 51 ms.
MID_DECODE_TOKENS = 87
GENERATE_ROOM = 64  # tokens a profiled sequence may still generate (a step-grid cell takes at most 37)


def workload_contexts(target, batch_size: int) -> list[int]:
    from starjar import workloads
    from starjar.model.text import encode_prompt

    lengths = sorted(len(encode_prompt(target.tokenizer, t, chat=True))
                     for t in workloads.texts(workloads.load("own", 80)))
    cap = max(1, target.max_context - GENERATE_ROOM)  # a short-context model profiles at its own longest
    return [min(cap, lengths[int((k + 0.5) / batch_size * len(lengths))] + MID_DECODE_TOKENS)
            for k in range(batch_size)]
_ids = itertools.count()


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _catch_up_round_s(engine, batch_size: int, new_tokens: int, repeats: int, vocab: int) -> float:
    """Median time of a round in which each of `batch_size` synced sequences brings `new_tokens` new tokens."""
    samples = []
    for _ in range(repeats):
        ids = [next(_ids) for _ in range(batch_size)]
        prompt = [(7 * i + 3) % vocab for i in range(CONTEXT)]
        engine.propose([DraftRequest(s, 0, prompt, 1) for s in ids])  # synced, as after a step
        extra = [(11 * i + 5) % vocab for i in range(new_tokens)]
        t0 = time.perf_counter()
        engine.propose([DraftRequest(s, CONTEXT, extra, 1) for s in ids])
        samples.append(time.perf_counter() - t0)
        engine.release(ids)
    return statistics.median(samples)


def profile_cswitch(draft, lengths, batch_sizes, repeats: int = 3, bar=None) -> dict:
    from draft_server.engine import DraftEngine

    engine = DraftEngine(draft, max_sequences=max(batch_sizes) * 2)
    vocab = min(draft.vocab_size, 32000)
    cost = []
    for length in lengths:
        row = []
        for b in batch_sizes:
            extra_s = (_catch_up_round_s(engine, b, length, repeats, vocab)
                       - _catch_up_round_s(engine, b, 1, repeats, vocab))
            row.append(max(0.0, extra_s))
            if bar is not None:
                bar.update()
        cost.append(row)
    return {"lengths": list(lengths), "batch_sizes": list(batch_sizes), "cost_s": cost}


def profile_target(target, ns, repeats: int = 4, bar=None) -> dict[int, float]:
    from controller.colocated import colocated_engine
    from starjar.spec.sampling import SamplingParams

    vocab = min(target.vocab_size, 32000)
    out = {}
    for n in ns:
        engine = colocated_engine(target, None, 0, n)
        params = SamplingParams(max_tokens=repeats + 8, ignore_eos=True)
        for i in range(n):
            engine.add_request([(13 * j + i) % vocab for j in range(CONTEXT)], params)
        engine.step()  # prefill
        engine.step()  # warm
        out[n] = _median_time(engine.step, repeats)
        if bar is not None:
            bar.update()
    return out


def profile_steps(target, draft, batch_sizes, gammas, repeats: int = 4, bar=None) -> dict:
    """Median decode-step time with B sequences at a fixed gamma, drafting included."""
    from controller.colocated import colocated_engine
    from starjar.spec.sampling import SamplingParams

    vocab = min(target.vocab_size, 32000)
    rows = []
    for b in batch_sizes:
        row = []
        for g in gammas:
            engine = colocated_engine(target, draft if g else None, g, b)
            params = SamplingParams(max_tokens=(repeats + 3) * (g + 1) + 2, ignore_eos=True)
            for i, context in enumerate(workload_contexts(target, b)):
                engine.add_request([(13 * j + 7 * i) % vocab for j in range(context)], params)
            engine.step()  # prefill
            engine.step()  # warm: the draft catches up on the prompt here
            row.append(_median_time(engine.step, repeats))
            if bar is not None:
                bar.update()
        rows.append(row)
    return {"batch_sizes": list(batch_sizes), "gammas": list(gammas), "seconds": rows}


def run_profile(target, draft, quick: bool = False) -> dict:
    lengths = [1, 16, 64] if quick else [1, 16, 64, 256, 1024]
    batch_sizes = [1, 2, 4] if quick else [1, 2, 4, 8, 16]
    ns = [1, 2, 4, 8] if quick else [1, 2, 4, 8, 16, 32, 64]
    gammas = [0, 1, 2] if quick else [0, 1, 2, 3, 4]
    bar = tqdm(total=len(lengths) * len(batch_sizes) + len(ns) + len(batch_sizes) * len(gammas),
               desc="profiling", unit="cell", file=sys.stderr)
    cswitch = profile_cswitch(draft, lengths, batch_sizes, bar=bar)
    t_of_n = profile_target(target, ns, bar=bar)
    steps = profile_steps(target, draft, batch_sizes, gammas, bar=bar)
    bar.close()
    from draft_server.engine import DraftEngine

    engine = DraftEngine(draft, max_sequences=4)
    prompt = list(range(3, 3 + CONTEXT))
    engine.propose([DraftRequest("d0", 0, prompt, 1)])
    step = iter(range(10**6))

    def one_step() -> None:
        k = next(step)
        engine.propose([DraftRequest("d0", CONTEXT + k, [5], 1)])

    d0 = _median_time(one_step, 8)
    from target_worker.tree_budget import measure_verify_budget

    budget = measure_verify_budget(target, prompt)
    from target_worker.elastic_kv import kv_bytes_per_token

    return {"cswitch": cswitch, "t_of_n": {str(k): v for k, v in t_of_n.items()}, "d0_s": d0, "step_s": steps,
            "kv_bytes_per_token": kv_bytes_per_token(target), "draft_weight_bytes": engine.weight_bytes(),
            "context_tokens": CONTEXT, "step_contexts": {b: workload_contexts(target, b) for b in batch_sizes},
            "verify_budget": budget["budget"], "verify_pass_s": budget["pass_s"],
            "target": target.path, "draft": draft.path}


def profile_to_file(target_dir: str | None, draft_dir: str | None, out: str, quick: bool = False) -> dict:
    """run_profile on a pair of model directories (missing ones: the default pair's), written to `out`."""
    import json

    from controller.colocated import load_pair
    from starjar.model.default_pair import build_default_pair

    if target_dir is None or draft_dir is None:
        pair = build_default_pair()
        target_dir, draft_dir = target_dir or pair["target"], draft_dir or pair["draft"]
    target, draft = load_pair(target_dir, draft_dir)
    t0 = time.time()
    result = run_profile(target, draft, quick=quick)
    # A latency table belongs to one machine: it names the CPU and capability, like every benchmark JSON.
    result["meta"] = {"command": "starjar profile", "quick": quick, "wall_s": round(time.time() - t0, 1),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **machine_info()}
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return result
