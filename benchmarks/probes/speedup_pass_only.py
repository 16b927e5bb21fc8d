"""What chain speculation gives on this machine when only its passes count.

For each batch size b this times, in one process and under one thread setting, the passes a speculative step
is made of, at the workload's own contexts (Spec-Bench first turns, as `bench core`):
  T(b, k)  a target pass over k tokens per row with logits at all of them (verification);
  D1(b)    a draft pass over one token per row (a draft step);
  D2(b)    a draft pass over two tokens per row (the catch-up that opens a round after a full accept).
With L(b, g), the mean tokens a round yields at gamma g (from a `bench core` JSON of the same machine), a round
of gamma g can at best run at

    pass_only(b, g) = L(b, g) * T(b, 1) / (D2(b) + (g - 1) * D1(b) + T(b, g + 1))

times the target alone, counting passes only: no prefill, bookkeeping or sampling on either side. It is an
estimate, not a bound: a plain step's own overhead would raise a measured ratio above it when a round costs more
than a step, and the catch-up is charged at two tokens although it is one after a rejection. What it shows is
where the pass costs alone leave a goal out of reach. Also printed: the draft/target cost D1/T(b,1) that a goal
speedup would need at the measured L, with no overhead at all.

    flock /tmp/starjar-cpu.lock python benchmarks/probes/speedup_pass_only.py \
        --core-json benchmarks/results/epyc-avx2-2c/core-quick.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from starjar.cpu.kernels import interleaved_medians

GOALS = {1: 1.5, 4: 1.15, 8: 1.0}  # the batch-size goals bench core is held to


def _pass_ms(model, cache, slots: list[int], lengths: list[int], k: int, all_logits: bool, repeats: int) -> float:
    """A pass of k tokens on each slot (logits at all k, or the last), rolled back after every run."""
    feeds = [[100 + 7 * j for j in range(k)] for _ in slots]
    rows = [list(range(k)) if all_logits else [k - 1] for _ in slots]

    def one() -> None:
        model.forward(cache, slots, feeds, rows)
        for s, n in zip(slots, lengths, strict=True):
            cache.truncate(s, n)

    return interleaved_medians([one], repeats)[0] * 1e3  # warmed once, then the median


def _prefilled(model, prompts: list[list[int]]):
    cache = model.new_cache()
    slots = [cache.allocate() for _ in prompts]
    for s, p in zip(slots, prompts, strict=True):
        model.forward(cache, [s], [p], [[len(p) - 1]])
    return cache, slots, [len(p) for p in prompts]


def measure(target, draft, prompts: list[list[int]], batch_sizes: list[int], max_k: int, repeats: int) -> dict:
    t_cache, t_slots, lengths = _prefilled(target, prompts)
    d_cache, d_slots, _ = _prefilled(draft, prompts)
    out = {}
    for b in batch_sizes:
        ts, ds, n = t_slots[:b], d_slots[:b], lengths[:b]
        out[b] = {"target_ms": {k: round(_pass_ms(target, t_cache, ts, n, k, True, repeats), 2)
                                for k in range(1, max_k + 1)},
                  "draft_step_ms": round(_pass_ms(draft, d_cache, ds, n, 1, False, repeats), 2),
                  "draft_catchup_ms": round(_pass_ms(draft, d_cache, ds, n, 2, False, repeats), 2)}
    return out


def pass_only(passes: dict, core: dict | None, max_k: int) -> dict:
    """Per batch size: the pass-only speedup at each gamma the core JSON measured, the best, the measured one."""
    runs = {(r["batch_size"], r["gamma"]): r for r in (core or {}).get("runs", [])}
    out = {}
    for b, p in passes.items():
        t1, d1, d2 = p["target_ms"][1], p["draft_step_ms"], p["draft_catchup_ms"]
        per_gamma = {}
        for g in range(1, max_k):
            run = runs.get((b, g))
            if run is None:
                continue
            length = run["mean_accepted_len"]
            cost = d2 + (g - 1) * d1 + p["target_ms"][g + 1]
            goal = GOALS.get(b)
            # The draft step cost at which this gamma would just reach the goal (catch-up counted as a step).
            need = (length * t1 / goal - p["target_ms"][g + 1]) / g / t1 if goal else None
            per_gamma[g] = {"mean_accepted_len": length, "pass_only": round(length * t1 / cost, 3),
                            "draft_cost_needed_for_goal": None if need is None else round(need, 3)}
        best = max(per_gamma.items(), key=lambda kv: kv[1]["pass_only"]) if per_gamma else None
        measured = (core or {}).get("speedup_by_batch", {}).get(str(b))
        out[b] = {"draft_over_target": round(d1 / t1, 3), "verify_cost": {k: round(v / t1, 3) for k, v in
                                                                         p["target_ms"].items()},
                  "per_gamma": per_gamma, "best_gamma": best[0] if best else None,
                  "pass_only": best[1]["pass_only"] if best else None, "goal": GOALS.get(b),
                  "measured_speedup": measured["speedup"] if measured else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core-json", help="a bench core result of this machine: the mean tokens per round")
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", required=True, help="result JSON (benchmarks/results/<machine kind>/...)")
    args = ap.parse_args()
    from benchmarks.common import prompt_ids
    from benchmarks.meta import result_meta
    from starjar.model.default_pair import build_default_pair
    from starjar.model.loading import load_model

    torch.set_num_threads(args.threads)
    pair = build_default_pair()
    target, draft = load_model(pair["target"]), load_model(pair["draft"], what="draft")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = prompt_ids(target.tokenizer, max(sizes))
    core = json.loads(Path(args.core_json).read_text()) if args.core_json else None
    max_k = 5
    passes = measure(target, draft, prompts, sizes, max_k, args.repeats)
    result = {"passes": {str(b): p for b, p in passes.items()},
              "pass_only": {str(b): v for b, v in pass_only(passes, core, max_k).items()},
              "contexts": [len(p) for p in prompts], "core_json": args.core_json,
              "meta": result_meta(torch=torch.__version__, benchmark="speedup_pass_only")}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for b, v in result["pass_only"].items():
        print(f"b{b}: draft/target {v['draft_over_target']}, verify cost {v['verify_cost']}, "
              f"pass-only {v['pass_only']} (gamma {v['best_gamma']}), measured {v['measured_speedup']}, "
              f"goal {v['goal']}")
        for g, pg in v["per_gamma"].items():
            print(f"   gamma {g}: L {pg['mean_accepted_len']}, pass-only {pg['pass_only']}, "
                  f"draft/target needed for the goal with no overhead {pg['draft_cost_needed_for_goal']}")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
