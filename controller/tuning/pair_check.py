"""What `starjar models build` measures once per machine: which draft variant is fastest here, with which gamma,
and whether speculation pays at all.

Kernels and memory bandwidth differ from CPU to CPU, so nothing is assumed. On prompts of our own (chat
template, no data set needed), in about a minute:
  1. the target alone decodes them at batch 1 (its greedy output, and the baseline speed);
  2. every draft candidate (the int8 copy with each int8 kernel path, with a full head and with a head over
     the first HEAD_VOCAB ids; then the best of those with finer activations, NUMERICS; then the best so far
     without 1, 2 or 4 of its layers, the ones whose loss lowers agreement least, controller.tuning.layer_skip, unless
     that best one loses at every gamma) is scored on the target's own output, teacher-forced:
     alpha = how often its top token is the target's next token (the per-token acceptance of a
     deterministic draft);
  3. step costs are timed on this machine, interleaved so that a noisy neighbour hits both sides: a draft
     step, a draft catch-up pass (3 positions) and a 4-sequence draft pass over the target's step, and the
     target's pass over gamma+1 positions; a candidate whose catch-up pass is a cliff (CLIFF x the cheapest)
     is not scored;
  4. the predicted batch-1 speedup E(gamma) / (v(gamma) + catch-up + (gamma-1) step) with
     E = (1 - alpha^(gamma+1)) / (1 - alpha) picks the candidate and gamma;
  5. real runs with that choice confirm it: the target alone and speculating, interleaved (CONFIRM_REPEATS
     each, alternating which goes first) so that a neighbour busy for part of the time shows as spread
     between repeats instead of as a verdict. A noisy try (repeats spread over SPREAD_MAX, or the load
     average says others hold the cores) or a loss is measured again, at most EXTRA_TRIES times
     (judge_try, decide). Speculation is turned off (default gamma 0) only when it lost beyond the spread
     on two quiet tries; where no try settles it the predicted gamma is kept, flagged "undecided".
The result is kept in the draft's starjar.json with the machine it was measured on (the chosen variant's
settings too, so every later load uses them); another machine measures again.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from controller.tuning import layer_skip, pair_confirm, scoring
from controller.tuning.scoring import (
    VARIANT_KEYS,
    best_gamma,
    explicit,
    speculating_speedup,
    variant_name,
)

OWN_PROMPTS = [
    "Explain how a hash map handles collisions, with a short Python example.",
    "Write a haiku about autumn rain, then explain its imagery.",
    "List five tips for a first job interview and say why each matters.",
    "What is the difference between weather and climate? Answer for a ten-year-old.",
    "Summarize the plot of Romeo and Juliet in four sentences.",
    "Convert 72 degrees Fahrenheit to Celsius and show the formula.",
]
KEY = "measured"
EARLIER = "measured_elsewhere"  # measurements another machine (or thread count) replaced, newest first
KEEP_EARLIER = 8
# The best of the kernel/head candidates is also tried with finer activations: the full 8-bit range, smoothing
# (starjar.model.smoothing) and both; on the default pair these took agreement from 0.74 to 0.87 (24 prompts).
NUMERICS = ({"act_bits": 8}, {"smooth_alpha": 0.5}, {"act_bits": 8, "smooth_alpha": 0.5})
HEAD_VOCAB = 16384  # covers 94% of the default target's output tokens on Spec-Bench
# Bumped when the draft's forward gets cheaper or dearer, so that measurements taken before are taken again
# (2: the scripted multi-row draft layer, starjar.model.lean_step; 3: candidates with finer activations, NUMERICS;
# 4: one-row passes in one native call, starjar.model.native_draft; 5: padded passes in it too).
DRAFT_FORWARD_REVISION = 5
# The same for the target's passes (2: few-row products chosen by measurement, starjar.cpu.skinny_linear; 3: MKL-packed
# weights where they measure faster; 4: the lean target forward, starjar.model.lean_target; 5: its fused projections,
# starjar.model.fused_projections; 6: its passes in one native call, starjar.model.native_pass; 7: the fused-or-apart
# choice timed with the native pass).
TARGET_FORWARD_REVISION = 7
# How agreement is measured (_agreement): a measurement taken another way is stale. "stepwise" replaced one
# teacher-forced pass, which overrated 8-bit activations on AVX2 kernels (0.823 against 0.323 in real steps).
AGREEMENT = "stepwise"
PAYS = 1.05  # a predicted batch-1 speedup below this is not worth a draft's memory and risk
CLIFF = 1.5  # a catch-up pass this many times the cheapest candidate's is a cliff kernel, not scored


def measured_acceptance(target_dir: str, draft_dir: str, force: bool = False, max_new: int = 32) -> dict:
    """The pair's measurement on this machine: cached in the draft's starjar.json, measured when missing,
    forced, or taken on another machine. A path forced by STARJAR_INT8_KERNEL has its own entry and leaves
    the recipe's chosen variant alone."""
    from starjar.cpu.machine import machine_info

    recipe_path = Path(draft_dir) / "starjar.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else {}
    machine = machine_fields(machine_info())
    key = measurement_key()
    if key in recipe and not force and recipe[key].get("machine") == machine:
        return recipe[key]
    # Measured here before, then replaced by another machine's (or another thread count's) measurement: taken
    # back, not measured again (a demo at 2 threads after a server at 1 measured for minutes each time).
    earlier = None if force else next((m for m in recipe.get(EARLIER, []) if m.get("key", KEY) == key
                                       and m.get("machine") == machine), None)
    result = earlier or measure_pair(target_dir, draft_dir, max_new, int8_draft=recipe.get("kind") == "dynamic-int8")
    result.pop("key", None)
    result["machine"] = machine
    replaced = recipe.get(key)
    kept = [m for m in recipe.get(EARLIER, []) if m is not earlier and not (  # one entry per key and machine
        replaced and m.get("key", KEY) == key and m.get("machine") == replaced.get("machine"))]
    if replaced and replaced.get("machine") != machine:  # a forced re-measurement here replaces, not keeps
        kept.insert(0, {**replaced, "key": key})
    recipe[EARLIER] = kept[:KEEP_EARLIER]
    recipe[key] = result
    if key == KEY:
        for k in VARIANT_KEYS:  # later loads use the chosen variant
            recipe.pop(k, None)
            if result["chosen"].get(k) is not None:
                recipe[k] = result["chosen"][k]
    recipe_path.write_text(json.dumps(recipe, indent=1))
    return result


def measurement_key() -> str:
    """Where a measurement lives in the recipe: "measured", or "measured:PATH" under a forced int8 path."""
    from starjar.cpu.kernels import forced_path

    return f"{KEY}:{forced_path()}" if forced_path() else KEY


def machine_fields(info: dict) -> dict:
    """What a measurement holds for: this CPU and torch (and the ISA limits it ran under), a kernel path forced
    by STARJAR_INT8_KERNEL, a KV precision forced by STARJAR_DRAFT_KV, the draft forward that was timed (a
    measurement of another revision of it, or of the eager path, is stale), starjar's own native kernels (another
    build of them times the passes differently: an upgrade measures the pair again, as it does the kernel
    choices) and how agreement and the confirmation were measured."""
    from starjar.cpu import skinny_linear
    from starjar.cpu.kernels import forced_choice, forced_path, native_digest
    from starjar.model import kv_precision, lean_step

    limits = info.get("isa_limits") or {}  # named only when set, so a machine used as it is keys as before
    kv = forced_choice(kv_precision.ENV, tuple(kv_precision.KV_DTYPES))  # likewise
    return {**{k: info[k] for k in ("cpu_model", "cpu_capability", "torch", "threads")},
            **({"isa_limits": limits} if limits else {}), **({"draft_kv_forced": kv} if kv else {}),
            "int8_kernel_forced": forced_path(), "agreement": AGREEMENT, "confirmation": pair_confirm.CONFIRMATION,
            "draft_forward": f"{DRAFT_FORWARD_REVISION}{'' if lean_step.enabled() else '-eager'}",
            "target_forward": f"{TARGET_FORWARD_REVISION}"
                              f"{'-' + skinny_linear.forced() if skinny_linear.forced() else ''}",
            "native_kernels": native_digest()}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure_pair(target_dir: str, draft_dir: str, max_new: int = 32, int8_draft: bool = True) -> dict:
    from controller.colocated import colocated_engine
    from starjar.cpu.kernels import INT8_PATHS, forced_path, machine_label
    from starjar.model.loading import load_model
    from starjar.model.text import encode_prompt
    from starjar.spec.sampling import SamplingParams

    _say(f"measuring the pair on this machine ({machine_label()}) ...")
    load_start = pair_confirm.load_average()
    target = load_model(target_dir, what="target")
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in OWN_PROMPTS]
    params = SamplingParams(max_tokens=max_new)
    colocated_engine(target, None, 0, 1).generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outputs = [r.output_ids for r in colocated_engine(target, None, 0, 1).generate(prompts, params)]
    alone_tps = sum(map(len, outputs)) / (time.perf_counter() - t0)
    verify_cost = scoring.verify_costs(target)
    _say(f"  target alone: {alone_tps:.1f} tok/s at batch 1; a pass over gamma+1 positions costs "
         + ", ".join(f"{v:.2f}" for v in verify_cost[1:]) + " x one position (gamma 1..)")

    paths = [forced_path()] if forced_path() else INT8_PATHS
    variants = [{"int8_kernel": k, "head_vocab": h} for k in paths for h in (None, HEAD_VOCAB)] \
        if int8_draft else [{}]
    candidates = _candidates(target, draft_dir, variants, prompts, outputs, verify_cost)
    if int8_draft:
        candidates += _candidates(target, draft_dir, _numerics_variants(draft_dir, candidates), prompts, outputs,
                                  verify_cost)
    scan = _skip_candidates(target, draft_dir, candidates, prompts, outputs, verify_cost) if int8_draft else {}
    best = _best(candidates, verify_cost)
    chosen = {k: best.get(k) for k in VARIANT_KEYS}
    result = {"prompts": len(prompts), "max_new_tokens": max_new, "target_alone_tokens_per_s": round(alone_tps, 2),
              "verify_cost": [round(v, 3) for v in verify_cost], **pair_confirm.spread_of(verify_cost, "verify_spread"),
              "candidates": candidates, "chosen": {**chosen, "name": best["name"]}, "skip_scan": scan,
              "predicted_speedup": best["predicted_speedup"]}
    if best["predicted_speedup"] < PAYS:
        if best["predicted_speedup"] > 0:
            why = f"the best draft ({best['name']}) predicts {best['predicted_speedup']:.2f}x at batch 1"
        else:  # none scored: each one's costs alone rule it out
            why = (f"even with every draft accepted, no draft would reach {PAYS:.2f}x at batch 1 (at most "
                   f"{best['ceiling']:.2f}x)")
        load = {"start": load_start, "end": pair_confirm.load_average()}
        # Step costs are interleaved medians, which a neighbour skews little; the prediction stands, but a busy
        # machine is named so that the user knows to measure again.
        busy = pair_confirm.machine_busy((load["start"], load["end"]), pair_confirm.torch_threads(),
                                         pair_confirm.usable_cpus())
        note = (f" (measured while the machine was busy, load {pair_confirm.max_load(load.values()):.1f}: run "
                f"`starjar models build --force` on a quiet machine to measure again)" if busy else "")
        result.update(gamma=0, acceptance_rate=None, speedup_batch1=1.0, confidence="predicted", load=load,
                      verdict=f"speculation does not pay on this machine: {why}; default gamma 0{note}")
        return result
    draft = load_model(draft_dir, what="draft", variant=explicit(chosen))
    result.update(pair_confirm.confirm(target, draft, best, prompts, params, outputs))
    result["load"] = {"start": load_start, "end": pair_confirm.load_average()}
    return result


def _candidates(target, draft_dir: str, variants: list[dict], prompts, outputs, verify_cost) -> list[dict]:
    """Each draft variant's measured costs, and (unless it is far costlier than the cheapest) its agreement
    with the target and the gamma and speedup they predict."""
    from starjar.model.loading import check_pair, load_model

    candidates = []
    for variant in variants:  # costs first: they decide which candidates are worth scoring
        draft = load_model(draft_dir, what="draft", variant=explicit(variant))
        check_pair(target, draft)
        row = {"name": variant_name(variant), **variant}
        costs = scoring.cost_ratios(target, draft)
        row["cost_b1"], row["cost_catchup"], row["cost_b4"] = (round(c, 3) for c in costs)
        row.update(pair_confirm.spread_of(costs, "cost_spread"))
        candidates.append(row)
        del draft
    cheapest = min((r["cost_catchup"] for r in candidates), default=0.0)
    for row in candidates:
        variant = {k: row[k] for k in VARIANT_KEYS if k in row}
        # The speedup model with every draft accepted: what no agreement could improve on.
        row["ceiling"] = ceiling = round(speculating_speedup(1.0, row["cost_b1"], row["cost_catchup"], verify_cost), 3)
        if row["cost_catchup"] > CLIFF * cheapest:  # a cliff kernel: scoring it would take minutes for nothing
            row.update(agreement=None, best_gamma=0, predicted_speedup=0.0,
                       note=f"not scored: a catch-up pass costs {row['cost_catchup'] / cheapest:.1f}x the cheapest")
        elif ceiling < PAYS:  # every candidate on a cliff path (forced): no agreement could make it pay
            row.update(agreement=None, best_gamma=0, predicted_speedup=0.0,
                       note=f"not scored: with every draft accepted it would predict at most {ceiling:.2f}x")
        else:
            row["agreement"] = round(scoring.agreement(load_model(draft_dir, what="draft", variant=explicit(variant)),
                                                prompts, outputs), 4)
            gamma, speedup = best_gamma(row["agreement"], row["cost_b1"], row["cost_catchup"], verify_cost)
            row.update(best_gamma=gamma, predicted_speedup=round(speedup, 3))
        _report(row)
    return candidates


def _best(candidates: list[dict], verify_cost: list[float]) -> dict:
    """The candidate with the highest predicted speedup. None paying, the least bad is kept, for a gamma forced by
    hand: the scored draft fastest at a gamma above 0 (a tie at 1.00x broken by the ceiling named a draft of
    agreement 0.375 on the int_mm cliff), or, none scored (every one ruled out by its costs), the highest ceiling."""
    return max(candidates, key=lambda r: (r["predicted_speedup"], _forced_speedup(r, verify_cost),
                                          r.get("ceiling", 0.0)))


def _forced_speedup(row: dict, verify_cost: list[float]) -> float:
    """A scored candidate's predicted speedup at its best gamma above 0 (below 1 where speculating loses); -1 for
    one not scored."""
    if row.get("agreement") is None:
        return -1.0
    return speculating_speedup(min(row["agreement"], 0.999), row["cost_b1"], row["cost_catchup"], verify_cost)


def _numerics_variants(draft_dir: str, candidates: list[dict]) -> list[dict]:
    """The best scored candidate's variant with each of NUMERICS (smoothing only where the draft's family allows)."""
    from starjar.model import smoothing
    model_type = json.loads((Path(draft_dir) / "config.json").read_text()).get("model_type")
    scored = [r for r in candidates if r.get("agreement") is not None]
    if not scored:
        return []
    best = max(scored, key=lambda r: r["predicted_speedup"])
    base = {k: best[k] for k in VARIANT_KEYS if k in best}
    return [{**base, **n} for n in NUMERICS if "smooth_alpha" not in n or model_type in smoothing.FAMILIES]


def _report(row: dict) -> None:
    """One candidate's line of the build's output: its costs, and its agreement and prediction (or why not)."""
    _say(f"  {row['name']}: step {row['cost_b1']:.2f}x the target's at batch 1, catch-up pass "
         f"{row['cost_catchup']:.2f}x, 4 rows {row['cost_b4']:.2f}x; "
         + (f"agreement {row['agreement']:.3f} -> gamma {row['best_gamma']}, predicted "
            f"{row['predicted_speedup']:.2f}x" if row["agreement"] is not None else row["note"]))


def _skip_candidates(target, draft_dir: str, candidates: list[dict], prompts, outputs, verify_cost) -> dict:
    """Add the best scored candidate with layers left out (controller.tuning.layer_skip); returns its per-layer scan."""
    scored = [r for r in candidates if r.get("agreement") is not None]
    best = max(scored, key=lambda r: r["predicted_speedup"], default=None)
    # Leaving layers out trades agreement for a few percent of a pass (one layer of the default pair: 0.906 ->
    # 0.734 for 3% of a step on a 2-core AMD EPYC); where the best draft is slower than no draft at every gamma,
    # the scan (one scoring per layer) is not run: on the int_mm cliff (AVX2 held, generic kernel) it had run over
    # 4 minutes of the demo's measurement, still scanning, for a verdict of gamma 0. A draft just short of PAYS is
    # still scanned: a cheaper copy may carry it over.
    if best is None or best["best_gamma"] == 0:
        return {}
    rows, scan = layer_skip.candidates(target, draft_dir, best, prompts, outputs, verify_cost)
    for row in rows:
        _report(row)
    candidates.extend(rows)
    return scan
