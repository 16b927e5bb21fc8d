"""Where a target worker's token-tree settings come from: the user's switch, and the verification budget
profiled on this machine (AdaServe section 3) rather than a constant.

The budget B is the number of tokens one target pass may verify while its time stays near that of a
one-token pass. Its sources, first that answers: the user's explicit budget; `verify_budget` in a
`starjar profile` JSON; a measurement at start (a few passes of the target, a second or so on the default
pair). `starjar serve target`, `starjar up`'s actors and the benchmarks all build their TreeConfig here.
"""

from __future__ import annotations

import json
import logging
import statistics
import time

from starjar.errors import InvalidArgument
from starjar.spec.tree_select import TREE_CHOICES, trees_on
from target_worker.tree_score import TreeConfig

log = logging.getLogger(__name__)

BUDGET_SLACK = 1.25  # the pass may take this much longer than a one-token pass
BUDGET_NS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def check_tree(value: str | None) -> str | None:
    if value is not None and value not in TREE_CHOICES:
        raise InvalidArgument("tree", f"one of {', '.join(TREE_CHOICES)}", value)
    return value


def measure_verify_budget(target, prompt: list[int], slack: float = BUDGET_SLACK,
                          ns: tuple[int, ...] = BUDGET_NS, repeats: int = 5) -> dict:
    """Median time of one target pass feeding n tokens after `prompt`: the budget is the largest n whose pass
    stays within `slack` x the one-token pass (where verifying more tokens is nearly free)."""
    times = {}
    for n in ns:
        cache = target.new_cache()
        slot = cache.allocate()
        target.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
        feed = (prompt * (1 + n // max(1, len(prompt))))[:n]
        samples = []
        for _ in range(repeats):
            cache.truncate(slot, len(prompt))
            t0 = time.perf_counter()
            target.forward(cache, [slot], [feed], [list(range(len(feed)))])
            samples.append(time.perf_counter() - t0)
        times[n] = statistics.median(samples)
    return {"pass_s": {str(n): round(t, 6) for n, t in times.items()}, "slack": slack,
            "budget": max(n for n, t in times.items() if t <= slack * times[ns[0]])}


def profiled_budget(profile_path: str | None) -> int | None:
    """`verify_budget` from a `starjar profile` JSON; None when there is no file or it predates the field."""
    if not profile_path:
        return None
    try:
        with open(profile_path) as f:
            value = json.load(f).get("verify_budget")
    except (OSError, ValueError) as exc:
        raise InvalidArgument("profile", "must be a JSON file written by `starjar profile`", profile_path) from exc
    if value is None:
        return None
    if not isinstance(value, int) or value < 1:
        raise InvalidArgument("profile", "verify_budget must be an integer >= 1", value)
    return value


def tree_config(tree: str | None, width: int, cap: int, budget: int | None, profile_path: str | None,
                target=None) -> tuple[TreeConfig | None, str]:
    """The engine's TreeConfig for the switch (None for chain, none and no switch) and a line that says where
    its budget came from. `target`: the loaded model, measured when neither budget nor profile gives one."""
    check_tree(tree)
    if not trees_on(tree):
        return None, f"trees: off ({tree or 'chain'})"
    source = "--tree-budget"
    if budget is None:
        budget, source = profiled_budget(profile_path), f"verify_budget of {profile_path}"
    if budget is None:
        if target is None:
            raise InvalidArgument("tree_budget", "needed: no profile with verify_budget and no model to measure",
                                  None)
        prompt = [(7 * i + 3) % target.vocab_size for i in range(64)]
        budget, source = measure_verify_budget(target, prompt)["budget"], "measured at start"
    cfg = TreeConfig(tree, width=width, budget=budget, cap=cap)
    return cfg, f"trees: {tree}, width {width}, cap {cap}, budget {budget} tokens per pass ({source})"
