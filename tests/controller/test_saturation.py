"""The controller's saturation guard: speculation off while a saturated draft makes steps slower, then back."""

from controller.fleet.saturation import SaturationGuard, Window, draft_window_load, window_rates


def test_forces_only_when_the_draft_is_saturated_and_speculation_loses():
    g = SaturationGuard(load_threshold=0.97, hold_s=30)
    assert g.decide(0, Window(0.80, 20.0, None)) is None  # the draft has room: nothing to learn
    assert g.decide(5, Window(0.80, 20.0, 25.0)) is None  # speculation loses but the draft has room
    assert g.decide(10, Window(0.99, 30.0, 25.0)) is None  # saturated, but speculation still wins
    assert g.decide(15, Window(0.99, 20.0, 25.0)) == "force"
    assert g.forcing and g.times_forced == 1
    assert g.decide(40, Window(None, None, 25.0)) is None  # holding
    assert g.decide(45, Window(0.0, None, 25.0)) == "release"
    assert not g.forcing
    assert g.decide(50, Window(0.99, 30.0, 25.0)) is None  # it looks again, with fresh evidence


def test_a_saturated_draft_with_no_plain_reference_gets_a_short_probe():
    g = SaturationGuard(hold_s=30, probe_s=6)
    assert g.decide(0, Window(0.99, 20.0, None)) == "force" and g.probes == 1 and g.times_forced == 0
    assert g.decide(5, Window(0.2, None, 25.0)) is None
    assert g.decide(6, Window(0.2, None, 25.0)) == "release"  # after probe_s, not hold_s
    assert g.decide(11, Window(0.99, 30.0, 25.0)) is None  # now it knows: speculation wins


def test_a_users_override_cancels_the_hold():
    g = SaturationGuard(hold_s=30)
    assert g.decide(0, Window(1.0, 10.0, 20.0)) == "force"
    g.cancel()
    assert not g.forcing and g.decide(1, Window(0.5, 10.0, 20.0)) is None


def test_windows_come_from_cumulative_counters():
    prev = {"t0": {"spec_tokens": 100, "spec_step_s": 10.0, "plain_tokens": 50, "plain_step_s": 2.0,
                   "fallback_tokens": 0, "fallback_step_s": 0.0}}
    cur = {"t0": {"spec_tokens": 160, "spec_step_s": 13.0, "plain_tokens": 50, "plain_step_s": 2.0,
                  "fallback_tokens": 2, "fallback_step_s": 1.0},  # a missed deadline: time spent trying
           "t1": {"spec_tokens": 40, "spec_step_s": 2.0, "plain_tokens": 30, "plain_step_s": 1.0,
                  "fallback_tokens": 0, "fallback_step_s": 0.0}}  # t1 is new
    spec, plain = window_rates(prev, cur)
    assert spec == (60 + 2 + 40) / (3.0 + 1.0 + 2.0) and plain == 30 / 1.0
    assert draft_window_load({"busy_s": 10, "idle_s": 10}, {"busy_s": 19, "idle_s": 11}) == 0.9
    assert draft_window_load({"busy_s": 10, "idle_s": 10}, {"busy_s": 10, "idle_s": 10}) is None
