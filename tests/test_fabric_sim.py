"""Issue 19: the star simulator (benchmarks/fabric_sim.py) against StarSD's closed forms."""

from __future__ import annotations

import pytest

from benchmarks.fabric_sim import PassCost, StarModel, assign, drafts_needed, n_full, simulate

S, Z, TAU = 0.010, 0.025, 3.0


def _model(**kw) -> StarModel:
    kw.setdefault("cost", PassCost([(1, S)]))
    return StarModel(z_s=Z, tokens_per_round=TAU, plain_step_s=0.02, **kw)


def test_one_target_cycles_in_z_plus_s():
    out = simulate(_model(wake_s=0.002), 1, 1, cycles=400)
    assert out["system_tokens_per_s"] == pytest.approx(TAU / (Z + S + 0.002), rel=0.02)
    assert out["draft_load"] == pytest.approx((S + 0.002) / (Z + S + 0.002), rel=0.02)


def test_fifo_saturates_at_n_full_and_a_second_draft_doubles_it():
    m = _model()
    assert n_full(m) == 4
    one = simulate(m, 8, 1, cycles=400)
    assert one["system_tokens_per_s"] == pytest.approx(TAU / S, rel=0.02) and one["draft_load"] > 0.99
    two = simulate(m, 8, 2, cycles=400)
    assert two["system_tokens_per_s"] == pytest.approx(2 * TAU / S, rel=0.02)


def test_batched_passes_serve_more_rounds_per_second():
    m = _model(mode="batched", cost=PassCost([(1, S), (8, 2 * S)]))
    assert PassCost([(1, S), (8, 2 * S)])(4) == pytest.approx(S + 3 * S / 7)
    fifo = simulate(_model(), 16, 1, cycles=200)["system_tokens_per_s"]
    assert simulate(m, 16, 1, cycles=200)["system_tokens_per_s"] > 2 * fifo


def test_targets_past_n_max_decode_alone():
    m = _model(n_max=3)
    assert sum(d is None for d in assign(8, 2, 3).values()) == 2
    out = simulate(m, 8, 2, cycles=400)
    assert out["without_draft"] == 2
    assert out["system_tokens_per_s"] == pytest.approx(2 * 3 * TAU / max(Z + S, 3 * S) + 2 / 0.02, rel=0.03)


def test_drafts_needed_follows_n_full():
    m = _model()
    need = drafts_needed(m, 64, share=0.9)
    assert 64 / n_full(m) <= need <= 64 / (n_full(m) - 2)


def test_calibration_reads_s_the_idle_penalty_and_z_from_replay_rows():
    from benchmarks.fabric import admitted, calibrate

    wake = 0.002
    rows = [{"mode": "fifo", "n": 1, "m": 1, "cycle_s": Z + S + wake, "busy_per_round_s": S + wake,
             "tokens_per_round": TAU, "passes_per_round": 4.0, "draft_load": 0.35},
            {"mode": "fifo", "n": 8, "m": 1, "cycle_s": 8 * S, "busy_per_round_s": S, "tokens_per_round": TAU,
             "passes_per_round": 4.0, "draft_load": 1.0}]
    m = calibrate(rows, "fifo", rows, plain_step_s=0.02)
    assert (m.z_s, m.cost(1), m.wake_s, m.tokens_per_round) == pytest.approx((Z, S, wake, TAU))
    batched = [dict(rows[0], mode="batched"), dict(rows[1], mode="batched", passes_per_round=1.0,
                                                     busy_per_round_s=S / 2)]
    b = calibrate(batched, "batched", rows, plain_step_s=0.02)
    assert b.cost(4) == pytest.approx(2 * S)  # 4 rounds per pass at S/2 each
    # Admission: speculating beats 50 tokens/s alone only while tau / (N S) > 50, i.e. N < 6.
    assert admitted(m).n_max == 5
