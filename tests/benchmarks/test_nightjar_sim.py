"""The simulated target worker behind `starjar bench nightjar`: its measured step costs, the draft's
catch-up, and the KV pool with Nightjar's offload rule (the engine's own ElasticRule)."""

from __future__ import annotations

import pytest

from benchmarks.sims.nightjar_sim import CostModel, Memory, SimRequest, simulate
from starjar.spec.policy import FixedGamma
from target_worker.elastic_kv import ElasticRule

PROFILE = {
    "t_of_n": {"1": 0.03, "8": 0.045, "64": 0.13, "512": 0.9},
    "d0_s": 0.012,
    "cswitch": {"lengths": [1, 64, 256], "batch_sizes": [1, 16], "cost_s": [[0, 0], [0.02, 0.2], [0.1, 1.0]]},
    "step_s": {"batch_sizes": [1, 4, 16], "gammas": [0, 1, 2],
               "seconds": [[0.034, 0.05, 0.07], [0.036, 0.077, 0.12], [0.06, 0.13, 0.19]]},
}


def test_steps_come_from_the_measured_grid_and_interpolate_between_batch_sizes():
    cost = CostModel(PROFILE)
    assert cost.step(4, 1) == pytest.approx(0.077)
    assert cost.step(10, 2) == pytest.approx(0.12 + (0.19 - 0.12) * 6 / 12)
    # A gamma above the grid continues its own measurements (linear in gamma), never T(n) and D0's composition,
    # so no arm the grid lacks is priced on another model than the arms it has.
    assert cost.step(1, 3) == pytest.approx(0.07 + (0.07 - 0.05))
    assert cost.step(16, 4) == pytest.approx(0.19 + 2 * (0.19 - 0.13))
    assert cost.step(16, 3) > cost.step(16, 2)
    assert cost.covers(16, 2) and not cost.covers(16, 3) and not cost.covers(32, 2)
    old = CostModel({k: v for k, v in PROFILE.items() if k != "step_s"})
    assert old.step(8, 0) == pytest.approx(0.045)


def test_mean_tpot_counts_from_each_request_s_first_token():
    cost = CostModel(PROFILE)
    # Three prefill together; the 1-token request ends there (no TPOT), the 2-token one after a step at batch 2,
    # the 3-token one after that step and one more alone.
    reqs = [SimRequest(0.0, 3, 0.0, 8), SimRequest(0.0, 2, 0.0, 8), SimRequest(0.0, 1, 0.0, 8)]
    out = simulate(FixedGamma(0), reqs, cost, max_batch=3)
    two, one = cost.step(2, 0), cost.step(1, 0)
    assert out.mean_tpot_s == pytest.approx(((two + one) / 2 + two) / 2)


def test_the_draft_catches_up_on_a_new_prompt_before_its_first_speculative_step():
    cost = CostModel(PROFILE)

    def run(gamma):
        reqs = [SimRequest(0.0, 2, 0.0, 200)]  # prefill gives token 1, one decode step gives token 2
        return simulate(FixedGamma(gamma), reqs, cost, max_batch=1)

    plain, spec = run(0), run(1)
    prefill = cost.prefill(200)
    assert plain.mean_e2e_s == pytest.approx(prefill + 0.034)
    assert spec.mean_e2e_s == pytest.approx(prefill + 0.05 + 0.02 + (0.1 - 0.02) * (201 - 64) / (256 - 64))


def test_elastic_rule_expands_after_persistent_pressure_and_contracts_with_hysteresis():
    rule = ElasticRule(n_draft=100, t_persist=3, tau_low_tokens=10)
    for _ in range(2):
        assert rule.before_step(free_tokens=5, waiting=True) is None
        rule.after_decode(0, 5, True)
    rule.after_decode(1, 5, True)  # a speculative step resets the count
    for _ in range(3):
        assert rule.before_step(5, True) is None
        rule.after_decode(0, 5, True)
    assert rule.before_step(5, True, draft_loaded=False) is None  # a reload still under way: nothing to lend
    assert rule.before_step(5, True) == "expand" and rule.expanded
    assert rule.before_step(105, False) is None  # free must exceed N_draft + tau_low
    assert rule.before_step(200, True) is None  # and nobody may be waiting
    assert rule.before_step(111, False) == "contract" and not rule.expanded
    assert (rule.expansions, rule.contractions) == (1, 1)


def test_offload_lends_the_draft_memory_under_pressure_in_the_simulator():
    cost = CostModel(PROFILE)
    reqs = [SimRequest(0.0, 60, 0.7, 40) for _ in range(24)]

    def run(elastic):
        rule = ElasticRule(n_draft=600, t_persist=4, tau_low_tokens=32) if elastic else None
        return simulate(FixedGamma(0), reqs, cost, max_batch=16, memory=Memory(500, 600, elastic=rule))

    off, on = run(False), run(True)
    assert on.offloads == 1 and off.offloads == 0
    assert on.peak_running > off.peak_running
    assert on.tokens_per_s > 1.05 * off.tokens_per_s
    assert off.preemptions > 2 * on.preemptions
    # Serving without speculation loads no draft: its pool holds both from the start, with no wait for
    # T_persist steps of pressure first.
    bare = simulate(FixedGamma(0), reqs, cost, max_batch=16, memory=Memory(500, 600, draft_loaded=False))
    assert bare.peak_running == 16 and bare.preemptions < on.preemptions
    assert bare.tokens_per_s >= on.tokens_per_s


def test_the_nightjar_bench_reads_its_trace():
    """`starjar bench nightjar` starts from the Azure trace: n arrival gaps, outputs and prompt lengths. (A zip of
    the timestamps with their own tail, made strict, once failed on every run before any figure.)"""
    from benchmarks.nightjar import _trace

    gaps, outs, prompts = _trace(20)
    assert len(gaps) == len(outs) == len(prompts) == 20
    assert all(g > 0 for g in gaps) and all(8 <= o <= 256 for o in outs) and all(p > 0 for p in prompts)
