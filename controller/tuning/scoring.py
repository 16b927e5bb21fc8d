"""How a draft candidate is scored against its target: teacher-forced agreement, pass costs in target steps, and
the speedup a gamma predicts from them (shared by the pair check and the layer-skip scan)."""

from __future__ import annotations

from controller.tuning import pair_confirm
from starjar.cpu.kernels import interleaved_times
from starjar.model.loading import DRAFT_VARIANT_KEYS

VARIANT_KEYS = DRAFT_VARIANT_KEYS  # recipe keys a candidate sets
MAX_GAMMA = 6


def explicit(variant: dict) -> dict:
    """Every variant key set (None: off), so a key the recipe on disk already holds (a smoothed draft measured
    again on another machine) does not leak into a candidate that does not name it."""
    return {**dict.fromkeys(VARIANT_KEYS), **variant}


def variant_name(variant: dict) -> str:
    if not variant:
        return "the draft as given"
    head = f"head over the first {variant['head_vocab']} ids" if variant.get("head_vocab") else "full head"
    finer = [f"{variant['act_bits']}-bit activations" if variant.get("act_bits") else "",
             f"smoothed (alpha {variant['smooth_alpha']})" if variant.get("smooth_alpha") else "",
             f"without layers {variant['skip_layers']}" if variant.get("skip_layers") else ""]
    return f"int8 copy ({', '.join([variant['int8_kernel'] + ' kernel', head] + [f for f in finer if f])})"


def agreement(draft, prompts, outputs, stepwise: bool = True) -> float:
    """Teacher-forced: how often the draft's top token at a position of the target's output is the target's.

    stepwise (the default): as drafting runs, the prompt in one pass, then the target's tokens one at a time,
    so each position comes from a one-row one-token step (the path most drafts take). Its numerics can differ
    from a multi-row pass's by machine: on fbgemm's AVX2 kernels (no VNNI) 8-bit activations saturate in
    one-row steps, whose range is the row's own [min, max], and not in multi-row passes, where every row is
    scaled to [-1, 1] first. On the default pair's int8 draft held to AVX2 (scripts/emulate_isa.sh), one pass
    gave 0.823 and one-token steps 0.323; on the Xeon's own kernels 0.833 and 0.870.
    stepwise=False: every position from one pass over the whole sequence (cheaper: the per-layer skip scan,
    which only ranks layers)."""
    import torch

    hits = total = 0
    for p, out in zip(prompts, outputs, strict=True):
        if not p or not out:
            continue
        cache = draft.new_cache()
        slot = cache.allocate()
        if stepwise:
            top = [draft.forward(cache, [slot], [p], [[len(p) - 1]])[0].argmax(-1)]
            top += [draft.forward(cache, [slot], [[tok]], [[0]])[0].argmax(-1) for tok in out[:-1]]
            top = torch.cat(top)
        else:
            ids = p + out
            top = draft.forward(cache, [slot], [ids[:-1]], [list(range(len(p) - 1, len(ids) - 1))])[0].argmax(-1)
        hits += sum(int(a) == b for a, b in zip(top, out, strict=True))
        total += len(out)
    return hits / max(total, 1)


def _pass(model, batch: int, positions: int, context: int = 96):
    """A callable that runs one pass of `positions` new tokens for `batch` sequences at `context` tokens."""
    cache = model.new_cache()
    slots = [cache.allocate() for _ in range(batch)]
    model.forward(cache, slots, [[5] * context] * batch, [[context - 1]] * batch)

    def run():
        model.forward(cache, slots, [[7] * positions] * batch, [list(range(positions))] * batch)
        for s in slots:
            cache.truncate(s, context)
    return run


def verify_costs(target) -> pair_confirm.Timed:
    """v[g] = the target's pass over g+1 positions at batch 1, over its one-position step."""
    times = interleaved_times([_pass(target, 1, g + 1) for g in range(MAX_GAMMA + 1)], reps=7)
    return pair_confirm.ratios(times, [(g, 0) for g in range(MAX_GAMMA + 1)])


def cost_ratios(target, draft) -> pair_confirm.Timed:
    """Draft passes over the target's one-position step: a one-token draft step and a 3-position catch-up at
    batch 1, and a 4-sequence pass over the target's 4-sequence step (batched drafting)."""
    times = interleaved_times([_pass(target, 1, 1), _pass(draft, 1, 1), _pass(draft, 1, 3),
                          _pass(target, 4, 1), _pass(draft, 4, 1)], reps=7)
    return pair_confirm.ratios(times, [(1, 0), (2, 0), (4, 3)])


def round_speedup(alpha: float, g: int, cost: float, catchup: float, verify_cost: list[float]) -> float:
    """A round of gamma g over the target alone: its expected tokens over its cost in target steps (one catch-up
    pass, which yields the first draft, g - 1 draft steps and a verification over g + 1 positions)."""
    if g == 0:
        return 1.0
    expected = g + 1 if alpha >= 1.0 else (1 - alpha ** (g + 1)) / (1 - alpha)
    return expected / (verify_cost[g] + catchup + (g - 1) * cost)


def speculating_speedup(alpha: float, cost: float, catchup: float, verify_cost: list[float]) -> float:
    """The highest round_speedup at a gamma above 0 (below 1 where every gamma loses to no speculation)."""
    return max(round_speedup(alpha, g, cost, catchup, verify_cost) for g in range(1, len(verify_cost)))


def best_gamma(alpha: float, cost: float, catchup: float, verify_cost: list[float]) -> tuple[int, float]:
    """The gamma (0 = no speculation) whose round_speedup is highest, and that speedup."""
    alpha = min(alpha, 0.999)
    best = (0, 1.0)
    for g in range(1, len(verify_cost)):
        speedup = round_speedup(alpha, g, cost, catchup, verify_cost)
        if speedup > best[1]:
            best = (g, speedup)
    return best
