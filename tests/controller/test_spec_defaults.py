"""How much a cluster speculates when the user forces nothing: what was measured on this machine."""

import json

from controller.tuning.pair_check import KEY, machine_fields
from controller.tuning.spec_defaults import UNMEASURED_MAX_GAMMA, speculation_defaults
from starjar.cpu.machine import machine_info


def _draft(tmp_path, gamma, machine=None):
    d = tmp_path / f"draft-{gamma}"
    d.mkdir()
    verdict = "speculation pays here" if gamma else "speculation does not pay on this machine"
    m = {"gamma": gamma, "verdict": verdict, "machine": machine or machine_fields(machine_info())}
    (d / "starjar.json").write_text(json.dumps({KEY: m}))
    return str(d)


def test_a_forced_gamma_is_obeyed(tmp_path):
    chosen = speculation_defaults(_draft(tmp_path, 0), gamma=2)
    assert (chosen.policy, chosen.gamma) == ("fixed", 2) and "forced" in chosen.note


def test_measured_to_pay_runs_nightjar_up_to_the_measured_gamma(tmp_path):
    chosen = speculation_defaults(_draft(tmp_path, 3))
    assert (chosen.policy, chosen.gamma) == ("nightjar", 3) and chosen.speculates


def test_measured_not_to_pay_turns_speculation_off_and_says_why(tmp_path):
    chosen = speculation_defaults(_draft(tmp_path, 0))
    assert (chosen.policy, chosen.gamma) == ("fixed", 0) and "does not pay" in chosen.note


def test_a_measurement_from_another_machine_or_none_lets_the_planner_explore(tmp_path):
    other = dict(machine_fields(machine_info()), cpu_model="some other CPU")
    for d in (_draft(tmp_path, 0, machine=other), "", str(tmp_path)):
        chosen = speculation_defaults(d)
        assert (chosen.policy, chosen.gamma) == ("nightjar", UNMEASURED_MAX_GAMMA)
    assert speculation_defaults(None).gamma == 0  # no draft at all
