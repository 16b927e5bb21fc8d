"""`starjar bench offload`: a co-located draft lending its memory to the target's KV under pressure.

The default pair, one target engine with an in-process draft and a tight KV
budget, every request queued at once (high load: the controller has turned
speculation off). Without offload the budget caps the running batch; with it,
after T_persist speculation-free steps under pressure the draft is offloaded
and the budget grows by N_draft tokens. Reports peak concurrent sequences,
tokens/s, greedy equality between the two runs, and the cost of the elastic
hook on the critical path (and of starting a reload).
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from benchmarks.common import pair_dirs, prompt_ids
from draft_server.engine import DraftEngine
from starjar.model.loading import kv_bytes_per_token, load_model
from starjar.spec.policy import FixedGamma, Overridable
from starjar.spec.sampling import SamplingParams
from target_worker.elastic_kv import ElasticKV
from target_worker.engine import EngineConfig, TargetEngine


def _run(target, draft_model, prompts, budget, max_tokens, elastic: bool, label: str) -> dict:
    draft = DraftEngine(draft_model, max_sequences=64)
    policy = Overridable(FixedGamma(1))
    policy.override = 0  # high load: speculation off
    kv = ElasticKV(draft, target, t_persist=8, tau_low_tokens=128) if elastic else None
    engine = TargetEngine(target, draft, policy, EngineConfig(max_batch_size=32, kv_budget_tokens=budget), elastic=kv)
    peak, bar = 0, tqdm(total=len(prompts), desc=label, file=sys.stderr)

    def on_step(outs):
        nonlocal peak
        peak = max(peak, engine.num_running)
        bar.update(sum(o.finished for o in outs))

    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), on_step=on_step)
    wall = time.perf_counter() - t0
    bar.close()
    out = {"peak_running": peak, "tokens_per_s": round(sum(len(r.output_ids) for r in reqs) / wall, 3),
           "wall_s": round(wall, 2), "preemptions": engine.stats.preemptions, "outputs": [r.output_ids for r in reqs]}
    if kv is not None:
        out["load_falls"] = _load_falls(engine, draft, prompts[:2])
        draft.wait_reloaded(60)
        out.update({"n_draft_tokens": kv.n_draft, "expansions": kv.expansions, "contractions": kv.contractions,
                    "hook_us_per_step": round(1e6 * kv.hook_s / max(1, kv.hook_calls), 2),
                    "reload_dispatch_us": round(1e6 * kv.reload_dispatch_s, 1) if kv.reload_dispatch_s else None,
                    "reload_s": round(draft.reloads[-1], 4) if draft.reloads else None})
    return out


def _load_falls(engine, draft, prompts) -> dict:
    """The flood is over and two short requests arrive: the budget shrinks back and the draft reloads in
    the background (what reload_dispatch_us and reload_s below measure) while the engine keeps stepping."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
    steps = while_reloading = 0
    while engine.has_work():
        while_reloading += draft.offloaded
        engine.step()
        steps += 1
    return {"steps": steps, "steps_started_while_reloading": while_reloading}


def run(args) -> dict:
    target_dir, draft_dir, note = pair_dirs(args)
    target, draft = load_model(target_dir), load_model(draft_dir)
    n, max_tokens = (12, 24) if args.quick else (32, 48)
    prompts = prompt_ids(target.tokenizer, n, args)
    mean_prompt = sum(len(p) for p in prompts) / len(prompts)
    budget = int(6 * (mean_prompt + max_tokens))  # room for about 6 sequences without offload
    off = _run(target, draft, prompts, budget, max_tokens, False, "offload off")
    on = _run(target, draft, prompts, budget, max_tokens, True, "offload on")
    same = sum(a == b for a, b in zip(off.pop("outputs"), on.pop("outputs"), strict=True))
    return {"pair": {"target": target_dir, "draft": draft_dir, "note": note},
            "requests": n, "max_tokens": max_tokens, "kv_budget_tokens": budget,
            "kv_bytes_per_token": kv_bytes_per_token(target),
            "draft_weight_bytes": DraftEngine(draft).weight_bytes(),
            "offload_off": off, "offload_on": on, "identical_outputs": f"{same}/{n}",
            "throughput_ratio_on_over_off": round(on["tokens_per_s"] / off["tokens_per_s"], 3),
            "note": "co-located, CPU: the draft's weights stay in host memory either way; what offload lends "
                    "the target is the budget its bytes stand for, as on a GPU"}
