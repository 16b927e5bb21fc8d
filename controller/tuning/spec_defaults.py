"""How much to speculate when the user does not say: what `starjar models build` measured on this machine.

A forced gamma (`--gamma N`, policy fixed) is always obeyed. Otherwise the servers run the Nightjar planner
with the measured best gamma as its largest arm, so speculation adapts to batch size and load; where the
measurement found that speculation does not pay on this machine, it is off (gamma 0) and the note says why.
A measurement that could not decide (the machine was busy while it was taken: "confidence": "undecided") kept the
predicted gamma, and its note says so; the planner still drops speculation per batch where it loses.
A draft that was never measured (a pair of the user's own) gets Nightjar up to gamma 4, which explores and
turns speculation off by itself where it loses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

UNMEASURED_MAX_GAMMA = 4


@dataclass(frozen=True)
class SpeculationDefaults:
    policy: str  # "fixed" or a planner name
    gamma: int  # fixed: every step; a planner: its largest arm
    note: str  # what was chosen and why, for the user

    @property
    def speculates(self) -> bool:
        return self.gamma > 0


def speculation_defaults(draft_dir: str | None, gamma: int | None = None, policy: str | None = None,
                         measure: bool = False, target_dir: str | None = None) -> SpeculationDefaults:
    """gamma/policy: what the user gave (None = not given). measure: run the pair measurement if the draft has
    none for this machine (the default pair's, as `starjar models build` does)."""
    if draft_dir is None:
        return SpeculationDefaults("fixed", 0, "no draft: the targets decode alone")
    if gamma is not None and policy in (None, "fixed"):
        return SpeculationDefaults("fixed", gamma, f"gamma {gamma} on every step (forced)")
    measured = _measured(draft_dir, target_dir if measure else None)
    if measured is None:
        return SpeculationDefaults(policy or "nightjar", gamma if gamma is not None else UNMEASURED_MAX_GAMMA,
                                   "no measurement of this pair on this machine: the planner explores "
                                   f"gamma 0..{gamma if gamma is not None else UNMEASURED_MAX_GAMMA}")
    if measured["gamma"] == 0 and gamma is None:
        return SpeculationDefaults("fixed", 0, measured["verdict"])
    top = gamma if gamma is not None else measured["gamma"]
    return SpeculationDefaults(policy or "nightjar", top, f"{measured['verdict']}; {policy or 'nightjar'} picks "
                                                          f"gamma 0..{top} per batch size")


def _measured(draft_dir: str, target_dir: str | None) -> dict | None:
    if not draft_dir:  # a draft whose files are elsewhere (a remote draft server of the user's own)
        return None
    if target_dir is not None:
        from controller.tuning.pair_check import measured_acceptance

        return measured_acceptance(target_dir, draft_dir)
    from controller.tuning.pair_check import machine_fields, measurement_key
    from starjar.cpu.machine import machine_info

    try:
        recipe = json.loads((Path(draft_dir) / "starjar.json").read_text())
    except (OSError, ValueError):
        return None
    m = recipe.get(measurement_key())
    return m if m and m.get("machine") == machine_fields(machine_info()) and "verdict" in m else None
