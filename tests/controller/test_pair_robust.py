"""`starjar models build` on a busy machine: the confirmation is timed in interleaved repeats, a noisy try or a
loss is measured again, and speculation is turned off only on a loss seen beyond the spread on quiet tries."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from controller.tuning import pair_check, pair_confirm, scoring
from controller.tuning.pair_confirm import decide, judge_try, relative_spread, settle

# Recorded: a 2-core machine measured at 2 threads (its own threads count in the load average).
THREADS, CPUS = 2, 2
QUIET = (0.4, 2.1)  # load before and after a try on a quiet machine
BUSY = (3.1, 3.6)  # another program holding a core


def _try(ratios, load=QUIET):
    return {"ratios": ratios, "load": list(load), **judge_try(ratios, load, THREADS, CPUS)}


def test_spread_is_the_range_of_the_repeats_over_their_median():
    assert relative_spread([1.16, 1.17, 1.19]) == pytest.approx(0.03 / 1.17)
    assert relative_spread([2.0, 2.0, 2.0]) == 0.0
    assert relative_spread([0.0, 0.0, 0.0]) == float("inf")


def test_a_try_is_read_from_its_repeats_and_the_load_around_it():
    quiet = _try([1.16, 1.19, 1.17])  # the quiet build: predicted 1.41x, confirmed 1.17x
    assert (quiet["speedup"], quiet["noisy"], quiet["busy"], quiet["outcome"]) == (1.17, False, False, "pays")
    assert quiet["spread"] == pytest.approx(0.026, abs=1e-3)
    # The busy build: one repeat fell on the other program, the median (0.90x) alone would have said "loses".
    hit = _try([1.12, 0.62, 0.90], BUSY)
    assert hit["noisy"] and hit["busy"] and hit["spread"] > pair_confirm.SPREAD_MAX and hit["outcome"] == "unclear"
    # Steady repeats, but the load says others held the cores: not a quiet loss either.
    assert _try([0.90, 0.91, 0.90], BUSY)["outcome"] == "unclear"
    assert _try([0.90, 0.91, 0.90], BUSY)["busy"] and not _try([0.90, 0.91, 0.90])["busy"]
    # Repeats far apart on a quiet load average: noisy all the same.
    assert _try([1.3, 0.8, 1.05])["noisy"] and not _try([1.3, 0.8, 1.05])["busy"]
    assert _try([0.80, 0.82, 0.81])["outcome"] == "loses"  # slower beyond the spread, quiet
    assert _try([0.98, 0.99, 0.985])["outcome"] == "unclear"  # within a still machine's noise of even
    assert _try([1.10, 1.60, 1.30], BUSY)["outcome"] == "pays"  # noisy, but faster in every repeat
    assert not judge_try([0.8, 0.8, 0.8], [None, None], THREADS, CPUS)["busy"]  # no load average here


def test_a_loss_must_be_seen_twice_on_quiet_tries_and_a_noisy_try_settles_nothing():
    busy, quiet_loss, pays = _try([1.12, 0.62, 0.90], BUSY), _try([0.80, 0.82, 0.81]), _try([1.16, 1.19, 1.17])
    assert decide([busy]) == "undecided"
    assert decide([busy, pays]) == "pays"
    assert decide([quiet_loss]) == "undecided"  # measured again before speculation is turned off
    assert decide([quiet_loss, quiet_loss]) == "loses"
    assert decide([quiet_loss, busy, quiet_loss]) == "loses"  # the noisy try between does not count
    assert decide([quiet_loss, busy]) == "undecided"
    assert decide([busy, busy, busy]) == "undecided"
    assert decide([quiet_loss, pays]) == "pays"
    assert decide([quiet_loss, quiet_loss, busy]) == "undecided"  # the last word was noisy


def test_the_verdict_says_how_sure_it_is():
    name = "int8 copy"
    tries = [_try([1.16, 1.19, 1.17])]
    out = settle(decide(tries), tries, name, 3, 1.41)
    assert (out["gamma"], out["confidence"], out["speedup_batch1"]) == (3, "confirmed", 1.17)
    assert "pays" in out["verdict"] and "confirmed 1.17x" in out["verdict"] and "±1%" in out["verdict"]
    assert "load 2.1" in out["verdict"] and out["spread"] == tries[0]["spread"]
    tries = [_try([1.12, 0.62, 0.90], BUSY), _try([1.3, 0.7, 0.95], BUSY), _try([0.9, 1.2, 0.6], BUSY)]
    out = settle(decide(tries), tries, name, 3, 1.40)
    assert (out["gamma"], out["confidence"]) == (3, "undecided")  # the prediction's gamma is kept
    assert out["verdict"].startswith("could not decide: repeats spread ±") and "the machine is busy" in out["verdict"]
    assert "keeping gamma 3" in out["verdict"] and "--force" in out["verdict"]
    assert "does not pay" not in out["verdict"]
    assert out["spread"] == min(t["spread"] for t in tries)  # the quietest try is the one reported
    tries = [_try([0.80, 0.82, 0.81]), _try([0.79, 0.80, 0.81])]
    out = settle(decide(tries), tries, name, 3, 1.40)
    assert (out["gamma"], out["confidence"]) == (0, "confirmed")
    assert "does not pay" in out["verdict"] and "default gamma 0" in out["verdict"]
    tries = [_try([0.80, 0.82, 0.81]), _try([1.3, 0.7, 0.95], BUSY)]
    out = settle(decide(tries), tries, name, 3, 1.40)
    assert (out["gamma"], out["confidence"]) == (3, "undecided") and "did not repeat" in out["verdict"]


class _Recorded:
    """_confirm_try replaced by recorded tries, in order (the rest of _confirm runs as it is)."""

    def __init__(self, *tries):
        self.tries, self.calls = list(tries), 0

    def __call__(self, target, draft, gamma, prompts, params):
        ratios, load = self.tries[self.calls]
        self.calls += 1
        stats = SimpleNamespace(acceptance_rate=0.75, drafted_tokens=120)
        reqs = [SimpleNamespace(output_ids=o) for o in OUTPUTS]
        return {"ratios": ratios, "load": list(load)}, stats, reqs


OUTPUTS = [[5, 6, 7], [8, 9]]
BEST = {"name": "int8 copy", "best_gamma": 3, "predicted_speedup": 1.40}


@pytest.mark.parametrize("recorded, calls, gamma, confidence", [
    # The busy build, then a quiet try: measured again, and confirmed.
    ([([1.12, 0.62, 0.90], BUSY), ([1.16, 1.19, 1.17], QUIET)], 2, 3, "confirmed"),
    # Busy throughout: bounded, and speculation is not turned off.
    ([([1.12, 0.62, 0.90], BUSY)] * 5, 1 + pair_confirm.EXTRA_TRIES, 3, "undecided"),
    # A quiet loss, seen again: off.
    ([([0.80, 0.82, 0.81], QUIET), ([0.79, 0.80, 0.81], QUIET)], 2, 0, "confirmed"),
    # Quiet and paying at once: one try.
    ([([1.16, 1.19, 1.17], QUIET)], 1, 3, "confirmed"),
])
def test_the_confirmation_measures_again_until_a_try_settles_it(monkeypatch, capsys, recorded, calls, gamma,
                                                                 confidence):
    rec = _Recorded(*recorded)
    monkeypatch.setattr(pair_confirm, "_confirm_try", rec)
    monkeypatch.setattr(pair_confirm, "torch_threads", lambda: THREADS)
    monkeypatch.setattr(pair_confirm, "usable_cpus", lambda: CPUS)
    out = pair_confirm.confirm(None, None, BEST, [[1], [2]], None, OUTPUTS)
    assert rec.calls == calls and len(out["confirm_tries"]) == calls
    assert (out["gamma"], out["confidence"], out["confirm_gamma"]) == (gamma, confidence, 3)
    assert out["identical"] == 2 and out["acceptance_rate"] == 0.75
    err = capsys.readouterr().err
    assert err.count("measuring again") == calls - 1
    if recorded[0][1] == BUSY and calls > 1:
        assert "the machine looked busy" in err


def test_an_undecided_measurement_keeps_the_predicted_gamma_for_the_planner(tmp_path):
    from controller.tuning.spec_defaults import speculation_defaults
    from starjar.cpu.machine import machine_info

    tries = [_try([1.12, 0.62, 0.90], BUSY)] * 3
    m = {**settle(decide(tries), tries, "int8 copy", 3, 1.40), "machine": pair_check.machine_fields(machine_info())}
    (tmp_path / "starjar.json").write_text(json.dumps({pair_check.KEY: m}))
    chosen = speculation_defaults(str(tmp_path))
    assert (chosen.policy, chosen.gamma) == ("nightjar", 3) and "could not decide" in chosen.note


def test_a_measurement_confirmed_by_one_run_is_measured_again(tmp_path, monkeypatch):
    from starjar.cpu.machine import machine_info

    machine = pair_check.machine_fields(machine_info())
    assert machine["confirmation"] == pair_confirm.CONFIRMATION
    old = {k: v for k, v in machine.items() if k != "confirmation"}  # as stored before the interleaved runs
    (tmp_path / "starjar.json").write_text(json.dumps({pair_check.KEY: {"gamma": 0, "verdict": "x", "machine": old,
                                                                        "chosen": {}}}))
    again = {"gamma": 2, "verdict": "y", "chosen": {}}
    monkeypatch.setattr(pair_check, "measure_pair", lambda *a, **k: dict(again))
    assert pair_check.measured_acceptance("target", str(tmp_path))["gamma"] == 2


def test_step_costs_carry_the_spread_of_their_repeats(models):
    costs = scoring.cost_ratios(models["llama"], models["draft"])
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert 0 <= costs.spread < float("inf")
    assert pair_confirm.spread_of(costs, "cost_spread") == {"cost_spread": round(costs.spread, 3)}
    assert pair_confirm.spread_of((1.0, 2.0), "cost_spread") == {}  # plain values carry none
    verify = scoring.verify_costs(models["llama"])
    assert len(verify) == scoring.MAX_GAMMA + 1 and verify[0] == 1.0 and verify.spread >= 0


# Two processes (one per core) spinning 0.15 s in every 0.25 s, for at most 40 s: busy for part of the time.
HOG = """
import time
print("spinning", flush=True)
end = time.time() + 40
while time.time() < end:
    t = time.time() + 0.15
    while time.time() < t:
        pass
    time.sleep(0.1)
"""


def test_a_neighbour_busy_for_part_of_the_build_does_not_turn_speculation_off(tmp_path, model_dirs, monkeypatch,
                                                                             capsys):
    draft_dir = tmp_path / "draft"
    shutil.copytree(model_dirs["draft"], draft_dir)
    # The prediction is fixed (a cheap draft that agrees 95% of the time: gamma above 0 at about 1.4x, as on the
    # default pair); the confirmation runs on the tiny pair for real, with the neighbour spinning in its first try.
    monkeypatch.setattr(pair_check, "OWN_PROMPTS", pair_check.OWN_PROMPTS[:3])  # short runs: the test stays short
    monkeypatch.setattr(scoring, "agreement", lambda *a, **k: 0.95)
    monkeypatch.setattr(scoring, "cost_ratios", lambda target, draft: (0.3, 0.45, 0.35))
    monkeypatch.setattr(scoring, "verify_costs", lambda target: [1.0 + 0.05 * g for g in range(7)])
    real_try, hogged = pair_confirm._confirm_try, []

    def first_try_hogged(*args):
        if hogged:
            return real_try(*args)
        procs = [subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            assert all(p.stdout.readline() for p in procs)  # both spinning before the try starts
            hogged.append(real_try(*args))
            return hogged[-1]
        finally:
            for p in procs:
                p.kill()
                p.wait()
                p.stdout.close()
    monkeypatch.setattr(pair_confirm, "_confirm_try", first_try_hogged)

    result = pair_check.measured_acceptance(model_dirs["llama"], str(draft_dir), max_new=12)
    predicted = result["predicted_speedup"]
    assert predicted >= pair_check.PAYS and result["confirm_gamma"] > 0 and hogged
    # What the decision rested on is kept: the load around the build and each try, and each try's spread.
    assert all(isinstance(x, float) for x in result["load"].values())
    tries = result["confirm_tries"]
    assert 1 <= len(tries) <= 1 + pair_confirm.EXTRA_TRIES
    for t in tries:
        assert len(t["ratios"]) == pair_confirm.CONFIRM_REPEATS and len(t["load"]) == 2
        assert t["spread"] == pytest.approx(relative_spread(t["ratios"]), rel=0.02, abs=5e-3)
    assert result["spread"] in [t["spread"] for t in tries]
    assert result["identical"] == result["prompts"]  # greedy speculation stays the target's output
    err = capsys.readouterr().err
    if tries[0]["outcome"] != "pays":  # the hogged try settled nothing by itself: measured again
        assert len(tries) > 1 and "measuring again" in err
    if result["gamma"] == 0:  # off only on quiet losses, the last one taken after the neighbour stopped
        quiet = [t for t in tries if not t["noisy"]]
        assert result["confidence"] == "confirmed" and len(tries) >= 2 and quiet[-1] is tries[-1]
        assert [t["outcome"] for t in quiet[-2:]] == ["loses", "loses"]
    else:
        assert result["gamma"] == result["confirm_gamma"]
        assert result["confidence"] in ("confirmed", "undecided")
        if result["confidence"] == "undecided":
            assert result["verdict"].startswith("could not decide") and "does not pay" not in result["verdict"]
    saved = json.loads((draft_dir / "starjar.json").read_text())
    assert saved[pair_check.KEY] == result


def test_a_prediction_below_pays_keeps_its_verdict_and_names_a_busy_machine(tmp_path, model_dirs, monkeypatch):
    draft_dir = tmp_path / "draft"
    shutil.copytree(model_dirs["draft"], draft_dir)
    # A catch-up pass of 3.5 target steps: no agreement could pay, nothing is scored or confirmed.
    monkeypatch.setattr(scoring, "cost_ratios", lambda target, draft: (0.6, 3.5, 3.4))
    monkeypatch.setattr(scoring, "agreement", lambda *a, **k: pytest.fail("scored a draft that cannot pay"))
    monkeypatch.setattr(pair_confirm, "_confirm_try", lambda *a, **k: pytest.fail("confirmed a draft that cannot pay"))
    monkeypatch.setattr(pair_confirm, "load_average", lambda: 3.5)  # another program holding a core of 2
    monkeypatch.setattr(pair_confirm, "torch_threads", lambda: THREADS)
    monkeypatch.setattr(pair_confirm, "usable_cpus", lambda: CPUS)
    result = pair_check.measured_acceptance(model_dirs["llama"], str(draft_dir), max_new=4)
    assert (result["gamma"], result["confidence"]) == (0, "predicted")
    assert result["load"] == {"start": 3.5, "end": 3.5} and result["verify_spread"] >= 0
    assert "does not pay" in result["verdict"] and "busy" in result["verdict"] and "--force" in result["verdict"]
