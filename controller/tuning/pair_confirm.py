"""How `starjar models build` confirms its choice: the chosen draft at its best gamma against the target alone,
in interleaved repeats, measured again while the machine looks busy or a loss has been seen only once, so that one
noisy sample never turns speculation off. The verdict says how sure it is (confirmed, undecided, predicted)."""

from __future__ import annotations

import os
import statistics
import sys
import time

# How the choice is confirmed (_confirm): a measurement confirmed another way is stale. "interleaved" replaced one
# speculative run against the target alone timed minutes earlier, which a neighbour busy for part of the build
# turned into 0.90x against a prediction of 1.40x (1.17x on a quiet run), and so into gamma 0.
CONFIRMATION = "interleaved"
CONFIRM_REPEATS = 3  # alone / speculative pairs per try
EXTRA_TRIES = 2  # tries after the first when one does not settle it
SPREAD_MAX = 0.15  # (max - min) / median of a try's per-repeat speedups above this: too noisy to decide on
MIN_MARGIN = 0.03  # a loss smaller than this is within a still machine's noise, whatever the spread
BUSY_SHARE = 0.5  # others' load average (ours taken out) at or above this share of our CPUs: the machine is busy


def confirm(target, draft, best: dict, prompts, params, outputs) -> dict:
    """Run the chosen draft at its best gamma against the target alone, interleaved, until a try settles whether
    it pays (decide) or EXTRA_TRIES more have not: the result decides the default gamma."""
    gamma, predicted = best["best_gamma"], best["predicted_speedup"]
    threads, cpus = torch_threads(), usable_cpus()
    tries, first = [], None
    for attempt in range(1 + EXTRA_TRIES):
        row, stats, reqs = _confirm_try(target, draft, gamma, prompts, params)
        row.update(judge_try(row["ratios"], row["load"], threads, cpus))
        tries.append(row)
        first = first or (stats, reqs)
        _say(f"  confirming {best['name']} at gamma {gamma}: {row['speedup']:.2f}x the target alone (repeats "
             + ", ".join(f"{r:.2f}" for r in row["ratios"]) + f"; spread ±{row['spread'] / 2:.0%})")
        decision = decide(tries)
        if decision != "undecided" or attempt == EXTRA_TRIES:
            break
        _say(f"  {_again_reason(row, predicted)} ({attempt + 1} of {EXTRA_TRIES})")
    stats, reqs = first
    identical = sum(r.output_ids == o for r, o in zip(reqs, outputs, strict=True))
    out = dict(acceptance_rate=round(stats.acceptance_rate, 3), drafted_tokens=stats.drafted_tokens,
               identical=identical, confirm_gamma=gamma, confirm_tries=tries)
    out.update(settle(decision, tries, best["name"], gamma, predicted))
    return out


def _confirm_try(target, draft, gamma: int, prompts, params) -> tuple[dict, object, list]:
    """One try: CONFIRM_REPEATS pairs of runs over the prompts, the target alone and speculating, each pair in
    the other order from the last so that a slow spell does not always land on the same side. Returns the try's
    record (per-repeat speedups, tokens per second, the load average before and after) and the first speculative
    run's engine stats and requests."""
    from controller.colocated import colocated_engine
    from starjar.spec.sampling import SamplingParams

    for d, g in ((None, 0), (draft, gamma)):  # warm-up: a cold first run would read as a slow repeat
        colocated_engine(target, d, g, 1).generate(prompts[:1], SamplingParams(max_tokens=4))
    load = [load_average()]
    alone, spec, first = [], [], None
    for i in range(CONFIRM_REPEATS):
        for side in (("alone", "spec") if i % 2 == 0 else ("spec", "alone")):
            eng = colocated_engine(target, draft if side == "spec" else None, gamma if side == "spec" else 0, 1)
            t0 = time.perf_counter()
            reqs = eng.generate(prompts, params)
            tps = sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t0)
            (spec if side == "spec" else alone).append(tps)
            if side == "spec" and first is None:
                first = (eng.stats, reqs)
    load.append(load_average())
    ratios = [s / a for s, a in zip(spec, alone, strict=True)]
    row = {"ratios": [round(r, 3) for r in ratios], "alone_tokens_per_s": [round(a, 2) for a in alone],
           "spec_tokens_per_s": [round(s, 2) for s in spec], "load": load}
    return row, first[0], first[1]


def relative_spread(values) -> float:
    """(max - min) / median: how far apart repeats of one measurement landed."""
    values = list(values)
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("inf")


def judge_try(ratios: list[float], load, threads: int, cpus: int) -> dict:
    """One try's reading from its per-repeat speedups and the load average around it: its speedup (the median),
    spread, whether it was noisy (spread over SPREAD_MAX, or others busy on the machine), and its outcome:
    "pays" (at least even on a quiet try, or faster in every repeat even on a noisy one), "loses" (slower beyond
    its spread on a quiet try) or "unclear"."""
    speedup, spread = statistics.median(ratios), relative_spread(ratios)
    busy = machine_busy(load, threads, cpus)
    noisy = spread > SPREAD_MAX or busy
    if min(ratios) >= 1.0 or (not noisy and speedup >= 1.0):
        outcome = "pays"
    elif not noisy and speedup < 1.0 - max(spread, MIN_MARGIN):
        outcome = "loses"
    else:
        outcome = "unclear"
    return {"speedup": round(speedup, 3), "spread": round(spread, 3), "busy": busy, "noisy": noisy,
            "outcome": outcome}


def decide(tries: list[dict]) -> str:
    """What the tries so far settle: "pays" (the last one paid), "loses" (the last two quiet ones both lost, the
    last try among them: turning speculation off takes a loss seen twice) or "undecided" (measure again, or,
    out of tries, keep the predicted choice)."""
    last = tries[-1]
    if last["outcome"] == "pays":
        return "pays"
    quiet = [t for t in tries if not t["noisy"]]
    if len(quiet) >= 2 and quiet[-1] is last and all(t["outcome"] == "loses" for t in quiet[-2:]):
        return "loses"
    return "undecided"


def settle(decision: str, tries: list[dict], name: str, gamma: int, predicted: float) -> dict:
    """The stored outcome of a confirmation: the default gamma, how sure it is ("confirmed" or "undecided"), the
    spread and speedup it rests on, and the verdict line `starjar models build` prints."""
    # Undecided: the quietest try is reported; otherwise the last, which settled it.
    row = tries[-1] if decision != "undecided" else min(tries, key=lambda t: (t["noisy"], t["spread"]))
    speedup, load = row["speedup"], max_load(row["load"])
    how = f"spread ±{row['spread'] / 2:.0%}" + (f", load {load:.1f}" if load is not None else "")
    out = {"speedup_batch1": speedup, "spread": row["spread"]}
    if decision == "pays":
        return {**out, "gamma": gamma, "confidence": "confirmed",
                "verdict": f"speculation pays here: {name} at gamma {gamma}, confirmed {speedup:.2f}x the target "
                           f"alone at batch 1 ({how})"}
    if decision == "loses":
        return {**out, "gamma": 0, "confidence": "confirmed",
                "verdict": f"speculation does not pay on this machine: {name} at gamma {gamma} ran {speedup:.2f}x "
                           f"the target alone, slower beyond the spread on two quiet tries ({how}); default gamma 0"}
    if row["noisy"]:
        why = f"repeats spread ±{row['spread'] / 2:.0%}" + (
            f" (load {load:.1f}, the machine is busy)" if row["busy"] else
            f" (load {load:.1f})" if load is not None else "")
    elif row["outcome"] == "loses":
        why = f"a loss ({speedup:.2f}x, {how}) that did not repeat on a quiet try"
    else:
        why = f"{speedup:.2f}x is within the spread of the target alone ({how})"
    return {**out, "gamma": gamma, "confidence": "undecided",
            "verdict": f"could not decide: {why}; {name} at gamma {gamma} measured {speedup:.2f}x against a "
                       f"predicted {predicted:.2f}x; keeping gamma {gamma} from the prediction: run "
                       f"`starjar models build --force` on a quiet machine"}


def _again_reason(row: dict, predicted: float) -> str:
    """Why a try is measured again, for the build's output."""
    load = max_load(row["load"])
    spread = f"repeats spread ±{row['spread'] / 2:.0%}" + (f", load {load:.1f}" if load is not None else "")
    if row["noisy"]:
        return f"the machine looked busy ({spread}): measuring again"
    if row["outcome"] == "loses":
        return (f"speculating ran {row['speedup']:.2f}x against a predicted {predicted:.2f}x ({spread}): measuring "
                f"again before turning it off")
    return f"speculating ran {row['speedup']:.2f}x, within the spread of the target alone ({spread}): measuring again"


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def max_load(loads) -> float | None:
    known = [x for x in loads if x is not None]
    return max(known) if known else None


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_busy(load, threads: int, cpus: int) -> bool:
    """Whether others held a good part of our CPUs: the load average, less our own threads (which count in it
    while we measure), at or above BUSY_SHARE of the CPUs we may run on."""
    peak = max_load(load)
    return peak is not None and peak - threads >= BUSY_SHARE * cpus


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Timed(tuple):
    """Values measured from interleaved repeats, with `spread`: the largest relative_spread of their per-repeat
    values (a record of how steady the machine was while they were timed)."""

    spread: float

    def __new__(cls, values, spread: float):
        obj = super().__new__(cls, values)
        obj.spread = spread
        return obj


def spread_of(values, key: str) -> dict:
    """{key: spread} for timings that carry one (a Timed), {} for plain values."""
    spread = getattr(values, "spread", None)
    return {key: round(spread, 3)} if spread is not None else {}


def ratios(times: list[list[float]], pairs: list[tuple[int, int]]) -> Timed:
    """times[a] over times[b] for each pair: the ratio of their medians, and the spread of the per-repeat ratios."""
    med = [statistics.median(t) for t in times]
    spread = max(relative_spread([x / y for x, y in zip(times[a], times[b], strict=True)]) for a, b in pairs)
    return Timed([med[a] / med[b] for a, b in pairs], spread)
