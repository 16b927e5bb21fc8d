"""Speculation policies behind one interface (`starjar.spec.policy.SpeculationPolicy`): Nightjar and the
baselines it is compared with. `make_policy(name, ...)` builds one by the name benchmarks and the CLI use
(NAMES); `serving_policy` adds "fixed" (always the configured gamma) for the servers, and `policy_help`
says all of it in a --policy flag's help, so no command lists the names by hand.
"""

from __future__ import annotations

from starjar.errors import InvalidArgument
from starjar.spec.policy import FixedGamma

NAMES = ("nightjar", "nightjar_paper", "none", "fixed_K", "dsd", "banditspec", "tide", "vllm_table", "sglang_ema",
         "hf_heuristic")
PLANNERS = tuple(n for n in NAMES if n not in ("none", "fixed_K"))  # those that pick gamma step by step


def policy_help(default: str) -> str:
    """The help of a --policy flag: every name serving_policy takes, and the flag's default."""
    return (f"fixed: --gamma every step; or a planner picking gamma in 0..--gamma each step: {', '.join(PLANNERS)}; "
            f"also none (never speculate) and fixed_K (K every step) (default: {default})")


def make_policy(name: str, max_gamma: int = 4, cswitch=None, profile: dict | None = None, seed: int | None = 0,
                buckets: tuple[int, ...] | None = None):
    """profile: `starjar profile`'s output: T(n) and D0 for tide, the step grid for nightjar's per-batch-size
    Gmax."""
    from starjar.spec.policies.banditspec import BanditSpecUCB
    from starjar.spec.policies.dsd import DSDPolicy
    from starjar.spec.policies.heuristics import HfHeuristic, SglangEma, VllmTable
    from starjar.spec.policies.nightjar import PAPER_BUCKETS, NightjarPlanner, arm_limits, speedup_bounds
    from starjar.spec.policies.tide import TidePolicy

    if name == "nightjar":
        # With a measured step grid, each batch size explores only the arms that could pay there.
        grid = profile.get("step_s") if profile else None
        limits = arm_limits(grid, max_gamma) if grid else None
        bounds = speedup_bounds(grid, max_gamma) if grid else None
        extra = {"buckets": buckets} if buckets else {}
        return NightjarPlanner(max_gamma, cswitch, seed=seed, limits=limits, bounds=bounds, **extra)
    if name == "nightjar_paper":  # Algorithm 1 exactly as printed: every gamma at every exact B
        return NightjarPlanner(max_gamma, cswitch, seed=seed, buckets=buckets or PAPER_BUCKETS, name=name,
                               elimination_z=None, lag_aware=False, clip_outliers=False)
    if name == "none":
        return FixedGamma(0)
    if name.startswith("fixed_") and name[6:].isdigit():
        return FixedGamma(int(name[6:]))
    if name == "dsd":
        return DSDPolicy(max_gamma)
    if name == "banditspec":
        return BanditSpecUCB(max_gamma)
    if name == "tide":
        if not profile:
            raise InvalidArgument("policy", "tide needs a latency profile (T(n) and D0)")
        return TidePolicy({int(k): v for k, v in profile["t_of_n"].items()}, profile["d0_s"],
                          gamma=min(2, max_gamma))
    if name == "vllm_table":
        return VllmTable(max_gamma=max_gamma)
    if name == "sglang_ema":
        return SglangEma(max_gamma)
    if name == "hf_heuristic":
        return HfHeuristic(max_gamma)
    raise InvalidArgument("policy", f"one of {', '.join(NAMES)}", name)


def load_policy(name: str, max_gamma: int = 4, profile_path: str | None = None, seed: int | None = 0,
                buckets: tuple[int, ...] | None = None):
    """make_policy with the tables of a `starjar profile` JSON (C_switch for nightjar, T(n) and D0 for tide)."""
    import json
    from pathlib import Path

    from starjar.spec.policies.nightjar import CSwitchTable

    profile = None
    if profile_path:
        try:
            profile = json.loads(Path(profile_path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument("profile", f"a JSON file written by `starjar profile` ({exc})", profile_path) from exc
    cswitch = CSwitchTable.from_dict(profile["cswitch"]) if profile and "cswitch" in profile else None
    return make_policy(name, max_gamma, cswitch, profile, seed, buckets)


def parse_buckets(text: str | None) -> tuple[int, ...] | None:
    """'1,2,4,8' -> (1, 2, 4, 8): the batch sizes where the planner's per-batch-size states start."""
    if not text:
        return None
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise InvalidArgument("buckets", "comma-separated positive integers", text) from None
    if not values or values[0] != 1 or len(values) > 256:
        raise InvalidArgument("buckets", "must start at 1, at most 256 values", text)
    return values


def serving_policy(name: str, gamma: int, profile_path: str | None, has_draft: bool,
                   buckets: tuple[int, ...] | None = None):
    """What servers run: `fixed` = always `gamma`; any other name picks gamma in 0..`gamma`. Wrapped so the
    controller can override it. Without a draft, never speculate."""
    from starjar.spec.policy import FixedGamma, Overridable

    if gamma < 0:
        raise InvalidArgument("gamma", "must be >= 0", gamma)
    if not has_draft:
        inner = FixedGamma(0)
    elif name == "fixed":
        inner = FixedGamma(gamma)
    else:
        inner = load_policy(name, max_gamma=gamma, profile_path=profile_path, buckets=buckets)
    return Overridable(inner)
