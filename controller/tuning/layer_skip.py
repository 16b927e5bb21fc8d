"""Self-speculation candidates for `starjar models build`: the best int8 copy with decoder layers left out.

Fewer layers make a draft step cheaper and its proposals less like the target's. Which layers matter least is
measured, not assumed: each layer is left out alone and the draft scored teacher-forced on the target's own
output (controller.tuning.pair_check's agreement); the SKIP_COUNTS least harmful layers then make one candidate each,
timed and scored like the others, so a skip set wins only where its predicted speedup does.

On the 2-core AMX Xeon (AVX512 capability) with the default pair, no layer was cheap to lose: in a recorded
build leaving out the least harmful one (16 of 30) took
agreement from 0.81 to 0.72 and the step from 0.27 to 0.26 of a target step; four layers left 0.51 at 0.24.
"""

from __future__ import annotations

SKIP_COUNTS = (1, 2, 4)


def candidates(target, draft_dir: str, base: dict, prompts, outputs, verify_cost) -> tuple[list[dict], dict]:
    """Rows for the candidates list (base's variant with 1, 2, 4 layers left out), and the per-layer scan
    {"layer": agreement with that layer left out} (string keys, as the recipe's JSON keeps them)."""
    from controller.tuning import scoring
    from controller.tuning.pair_confirm import spread_of
    from controller.tuning.scoring import VARIANT_KEYS, best_gamma, explicit, variant_name
    from starjar.model.loading import load_model

    variant = {k: base.get(k) for k in VARIANT_KEYS if k != "skip_layers"}
    draft = load_model(draft_dir, what="draft", variant=explicit(variant))
    if draft.lean is None:
        return [], {}
    layers = len(draft.lean.plan)
    scan = {}
    for i in range(layers):
        draft.lean.leave_out((i,))
        scan[str(i)] = round(scoring.agreement(draft, prompts, outputs, stepwise=False), 4)  # a ranking only
    ranked = sorted(range(layers), key=lambda i: -scan[str(i)])
    rows = []
    for k in SKIP_COUNTS:
        if k >= layers:
            break
        skip = sorted(ranked[:k])
        draft.lean.leave_out(tuple(skip))
        row = {**variant, "skip_layers": skip}
        row["name"] = variant_name(row)
        costs = scoring.cost_ratios(target, draft)
        row["cost_b1"], row["cost_catchup"], row["cost_b4"] = (round(c, 3) for c in costs)
        row.update(spread_of(costs, "cost_spread"))
        row["agreement"] = round(scoring.agreement(draft, prompts, outputs), 4)
        gamma, speedup = best_gamma(row["agreement"], row["cost_b1"], row["cost_catchup"], verify_cost)
        row.update(best_gamma=gamma, predicted_speedup=round(speedup, 3))
        rows.append(row)
    return rows, scan
