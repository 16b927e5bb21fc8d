"""Speculation policies: Nightjar's planner in a synthetic environment, each baseline's rule, and
greedy outputs under every policy identical to the target alone."""

from __future__ import annotations

import math
import random

import pytest

from starjar.spec.policies import NAMES, make_policy
from starjar.spec.policies.banditspec import BanditSpecUCB
from starjar.spec.policies.dsd import DSDPolicy
from starjar.spec.policies.heuristics import HfHeuristic, SglangEma, VllmTable
from starjar.spec.policies.nightjar import CSwitchTable, NightjarPlanner
from starjar.spec.policies.tide import TidePolicy

# Expected latency per token by gamma: gamma 2 is best at batch 1, no speculation at batch 16.
LATENCY = {1: [1.0, 0.8, 0.7, 0.75, 0.9], 16: [0.3, 0.36, 0.42, 0.5, 0.6]}
SWITCH_S = 0.5  # what a 0 -> gamma > 0 transition costs, amortized over gamma in the loss


def simulate(policy, steps: int, batch_size: int = 1, seed: int = 0) -> tuple[float, int]:
    """(cumulative regret against the best fixed gamma, switches) under Nightjar's loss (Eq. 5)."""
    rng = random.Random(seed)
    means = LATENCY[batch_size]
    best = min(means)
    regret, prev, switches = 0.0, 0, 0
    for _ in range(steps):
        g = policy.choose(batch_size)
        lat = means[g] * (1 + 0.2 * (rng.random() - 0.5))
        loss = lat + (SWITCH_S / g if prev == 0 and g > 0 else 0.0)
        regret += loss - best
        switches += g != prev
        prev = g
        tokens = 10
        policy.observe(batch_size, g, lat * tokens, tokens, 0, 0)
    return regret, switches


def _nightjar(seed):
    return NightjarPlanner(max_gamma=4, cswitch=CSwitchTable([1], [1], [[SWITCH_S]]), seed=seed)


def test_nightjar_regret_grows_sublinearly_and_switches_like_sqrt_t():
    t = 16000
    r1 = [simulate(_nightjar(s), t, seed=s) for s in range(5)]
    r4 = [simulate(_nightjar(s), 4 * t, seed=s) for s in range(5)]
    regret_1 = sum(r for r, _ in r1) / 5
    regret_4 = sum(r for r, _ in r4) / 5
    switches_1 = sum(s for _, s in r1) / 5
    switches_4 = sum(s for _, s in r4) / 5
    assert 0 < regret_4 / regret_1 < 3.0, (regret_1, regret_4)  # linear would be 4, sqrt(T) gives 2
    assert switches_4 / switches_1 < 2.6, (switches_1, switches_4)
    assert switches_4 < 6 * math.sqrt(4 * t)


def test_nightjar_learns_each_batch_size_separately():
    p = _nightjar(1)
    for _ in range(3000):
        for b in (1, 16):
            g = p.choose(b)
            p.observe(b, g, LATENCY[b][g] * 10, 10, 0, 0)
    est = p.estimates()
    assert min(range(5), key=lambda g: est[1][g]) == 2
    assert min(range(5), key=lambda g: est[16][g]) == 0
    p.prev_gamma = 2  # speculating already: no switching cost in the comparison
    assert p._exploit(p._state[1], 1) == 2 and p._exploit(p._state[16], 16) == 0


def test_exploration_stops_paying_for_arms_clearly_worse_than_the_best():
    """Nightjar explores only arms whose confidence interval still reaches the best arm's; the paper's uniform
    exploration (elimination_z=None) keeps picking arms 20-100% slower at batch 16."""
    def explored(z):
        p = NightjarPlanner(max_gamma=4, cswitch=CSwitchTable([1], [1], [[SWITCH_S]]), seed=5, elimination_z=z)
        picks = []
        for _ in range(20000):
            n = p.explorations
            g = p.choose(16)
            if p.explorations > n:
                picks.append(g)
            p.observe(16, g, LATENCY[16][g] * 10, 10, 0, 0)
        return picks, p

    pruned, p = explored(2.0)
    uniform, _ = explored(None)
    def share(picks):  # of the later explorations, those that paid for a worse arm
        late = picks[len(picks) // 2:]
        return sum(g > 0 for g in late) / len(late)

    # Only a block's first bin still tries every arm (an arm is not ruled out for good); the rest try the best.
    assert share(pruned) < 0.3 and share(uniform) > 0.6, (share(pruned), share(uniform))
    assert p._state[16].worth_exploring(2.0, 8) == [0]
    regret = [simulate(_nightjar(s), 16000, batch_size=16, seed=s)[0] for s in range(3)]
    paper = [simulate(NightjarPlanner(max_gamma=4, cswitch=CSwitchTable([1], [1], [[SWITCH_S]]), seed=s,
                                      elimination_z=None), 16000, batch_size=16, seed=s)[0] for s in range(3)]
    assert sum(regret) < 0.7 * sum(paper), (regret, paper)


def test_switching_cost_keeps_speculation_off_when_it_does_not_amortize():
    # gamma 1 is slightly faster per token, but re-enabling it costs far more than it saves.
    table = CSwitchTable([1, 64], [1, 8], [[5.0, 5.0], [5.0, 5.0]])
    p = NightjarPlanner(max_gamma=1, cswitch=table, seed=3)
    st_means = [1.0, 0.95]
    for _ in range(200):  # learn both arms
        g = p.choose(1)
        p.observe(1, g, st_means[g], 1, 0, 0)
    p.prev_gamma = 0
    assert p._exploit(p._state[1], 1) == 0
    p.prev_gamma = 1  # already speculating: no switch to pay
    assert p._exploit(p._state[1], 1) == 1


def test_cswitch_table_lookup_is_conservative_and_round_trips(tmp_path):
    t = CSwitchTable([128, 256, 512], [2, 4, 8], [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert t.lookup(100, 2) == 1 and t.lookup(129, 2) == 4 and t.lookup(4000, 64) == 9 and t.lookup(256, 3) == 5
    path = tmp_path / "c.json"
    import json
    path.write_text(json.dumps(t.to_dict()))
    assert CSwitchTable.load(path).lookup(300, 5) == 9  # rounds up to (512, 8)


def test_ucb_converges_to_the_best_arm():
    regret, _ = simulate(BanditSpecUCB(4, c=0.3), 6000)
    p = BanditSpecUCB(4, c=0.3)
    simulate(p, 6000)
    assert max(range(5), key=lambda g: p.counts[g]) == 2


def test_dsd_fits_its_latency_model_and_stops_speculating_when_it_costs():
    p = DSDPolicy(4)
    rng = random.Random(0)
    for _ in range(300):  # verification is expensive per token here: every draft token costs 0.02 s per row
        b = rng.choice([1, 4, 8])
        g = rng.randint(0, 4)
        p.observe(b, g, 0.03 + 0.02 * b * (g + 1) + 0.005 * g, b, b * g // 4, b * g)
    assert p.choose(8) == 0
    cheap = DSDPolicy(4)
    for _ in range(300):  # verification nearly free, acceptance high: speculate fully
        b, g = rng.choice([1, 4, 8]), rng.randint(0, 4)
        cheap.observe(b, g, 0.03 + 0.0001 * b * (g + 1) + 0.001 * g, b, int(b * g * 0.9), b * g)
    assert cheap.choose(1) == 4


def test_tide_switches_off_where_its_speedup_model_says_so():
    t = {1: 0.030, 2: 0.031, 4: 0.033, 8: 0.040, 16: 0.060, 32: 0.110, 64: 0.210, 128: 0.410}
    p = TidePolicy(t, d0_s=0.008, gamma=2, alpha0=0.7)
    assert p.choose(1) == 2 and p.speedup(1) > 1
    assert p.choose(32) == 0 and p.speedup(32) < 1


def test_vllm_table_sglang_ema_and_hf_heuristic_follow_their_rules():
    table = VllmTable({1: 3, 4: 1, 8: 0})
    assert [table.choose(b) for b in (1, 3, 4, 7, 8, 100)] == [3, 3, 1, 1, 0, 0]
    hf = HfHeuristic(max_gamma=6, start=3)
    hf.observe(1, 3, 0.1, 4, 3, 3)
    assert hf.choose(1) == 5
    hf.observe(1, 5, 0.1, 2, 1, 5)
    assert hf.choose(1) == 4
    ema = SglangEma(max_gamma=4, probe_every=5)
    for _ in range(40):
        ema.observe(1, 2, 0.1, 1, 0, 2)  # nothing accepted
    assert ema.choose(1) == 0
    assert [ema.choose(1) for _ in range(5)][-1] == 1  # the periodic probe
    for _ in range(40):
        ema.observe(2, 2, 0.1, 3, 2, 2)  # everything accepted (same range as batch 1)
    assert ema.choose(2) == 4


def test_make_policy_knows_every_name():
    profile = {"t_of_n": {1: 0.03, 8: 0.04, 64: 0.2}, "d0_s": 0.01}
    names = [n for n in NAMES if n != "fixed_K"] + ["fixed_1", "fixed_3"]
    for n in names:
        p = make_policy(n, max_gamma=3, profile=profile)
        assert p.name == ("none" if n == "none" else n)
        assert 0 <= p.choose(4) <= 3
    from starjar.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="policy"):
        make_policy("magic")


@pytest.mark.parametrize("name", ["nightjar", "nightjar_paper", "none", "fixed_2", "dsd", "banditspec", "tide",
                                  "vllm_table", "sglang_ema", "hf_heuristic"])
def test_greedy_output_is_the_target_alone_under_every_policy(name, models, prompt_ids, reference):
    from controller.colocated import colocated_engine
    from starjar.spec.sampling import SamplingParams

    policy = make_policy(name, max_gamma=4, profile={"t_of_n": {1: 0.01, 4: 0.012, 16: 0.03}, "d0_s": 0.002})
    engine = colocated_engine(models["llama"], models["draft"], 0, 4, policy=policy)
    prompts = prompt_ids[:8]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [r.output_ids for r in reqs] == [r[:24] for r in reference("llama", 64)[:8]]


def test_arm_limits_keep_each_batch_size_to_the_arms_that_could_pay():
    from starjar.spec.policies.nightjar import arm_limits

    # Measured steps (s): at B=1 every gamma could pay; at B=16 even gamma 4 with every draft accepted
    # (5 tokens per sequence) costs more per token than plain decoding.
    grid = {"batch_sizes": [1, 4, 16], "gammas": [0, 1, 2, 3, 4],
            "seconds": [[0.035, 0.05, 0.068, 0.08, 0.10], [0.034, 0.073, 0.115, 0.124, 0.18],
                        [0.059, 0.132, 0.189, 0.246, 0.31]]}
    limits = arm_limits(grid, 4)
    assert limits == {1: 4, 4: 3, 16: 0}
    assert arm_limits(grid, 2) == {1: 2, 4: 0, 16: 0}  # at B=4 only gamma 3 could pay
    p = make_policy("nightjar", 4, profile={"step_s": grid}, seed=0)
    assert p.gmax(16) == 0 and p.gmax(40) == 0 and p.gmax(1) == 4
    assert p.gmax(8) == 3  # between profiled sizes: the larger limit of the two neighbours
    seen = {p.choose(16) for _ in range(2000)}
    assert seen == {0}  # no exploration of arms that cannot pay
    assert {p.choose(1) for _ in range(2000)} == {0, 1, 2, 3, 4}
    paper = make_policy("nightjar_paper", 4, profile={"step_s": grid}, seed=0)
    assert {paper.choose(16) for _ in range(2000)} == {0, 1, 2, 3, 4} and paper.bucket(13) == 13


def test_buckets_are_configurable_and_checked():
    from starjar.errors import InvalidArgument
    from starjar.spec.policies import parse_buckets, serving_policy

    assert parse_buckets("8, 1,2,4") == (1, 2, 4, 8) and parse_buckets(None) is None
    for bad in ("0,2", "a,b", "2,4"):
        with pytest.raises(InvalidArgument, match="buckets"):
            parse_buckets(bad)
    p = serving_policy("nightjar", 3, None, True, parse_buckets("1,4,16"))
    assert p.inner.buckets == (1, 4, 16) and p.inner.bucket(7) == 4 and p.inner.bucket(100) == 16


def test_a_step_that_carries_a_draft_prefill_is_kept_from_the_policy(models, prompt_ids, reference):
    """A new request's first drafting round makes the draft prefill its whole prompt: a cost of the request,
    paid once whatever gamma is. Charged to the gamma that happened to be on, a long prompt's prefill (over a
    second for 700 tokens on the default pair) swamped that arm's mean and the planner drifted off it."""
    from controller.colocated import colocated_engine
    from starjar.spec.policy import FixedGamma
    from starjar.spec.sampling import SamplingParams

    events = []

    class Recording(FixedGamma):
        def observe(self, batch_size, gamma, step_s, tokens, accepted, drafted):
            events.append(("observe", gamma))

    engine = colocated_engine(models["llama"], models["draft"], 0, 4, policy=Recording(3))
    draft = engine.proposer
    ask = draft.propose

    def propose(reqs):
        events.append(("propose", any(r.start == 0 for r in reqs)))
        return ask(reqs)

    draft.propose = propose
    reqs = engine.generate(prompt_ids[:10], SamplingParams(max_tokens=24))
    assert [r.output_ids for r in reqs] == [r[:24] for r in reference("llama", 64)[:10]]
    proposals = [e for e in events if e[0] == "propose"]
    assert sum(p[1] for p in proposals) >= 3  # rounds that carried prompts happened (10 requests, batch 4)
    last = None
    for kind, value in events:
        if kind == "propose":
            last = value
        else:
            assert last is False  # every step the policy saw drafted from a draft that already had the prompt
    observed = sum(1 for e in events if e[0] == "observe")
    st = engine.stats
    assert st.draft_prefill_steps == sum(p[1] for p in proposals)
    assert observed == st.spec.steps + st.plain.steps - st.draft_prefill_steps > 0


# C_switch grid for the lag tests: a catch-up of L tokens on B sequences costs about L x B x 1 ms.
LAG_TABLE = CSwitchTable([1, 16, 256, 1024], [1, 8], [[0.001, 0.008], [0.016, 0.128], [0.256, 2.048],
                                                       [1.024, 8.192]])
# Step grid: at batch 8 gamma 2 would be 1.2x plain with every draft accepted; at batch 1, 1.9x.
LAG_GRID = {"batch_sizes": [1, 8], "gammas": [0, 1, 2], "seconds": [[0.03, 0.04, 0.047], [0.06, 0.12, 0.15]]}


def _lag_planner(seed=0):
    from starjar.spec.policies.nightjar import arm_limits, speedup_bounds

    return NightjarPlanner(2, LAG_TABLE, seed=seed, limits=arm_limits(LAG_GRID, 2),
                           bounds=speedup_bounds(LAG_GRID, 2))


def test_catch_up_prices_the_longest_row_alone():
    # One 770-token prompt among six 10-token lags: the long row alone plus six short ones, not seven rows of 118.
    cost = LAG_TABLE.catch_up([770] + [10] * 6)
    assert cost == pytest.approx(LAG_TABLE.estimate(770, 1) + LAG_TABLE.estimate(10, 6))
    assert LAG_TABLE.estimate(256, 8) == pytest.approx(2.048) and LAG_TABLE.estimate(640, 1) == pytest.approx(0.64)


def test_a_catch_up_that_cannot_be_repaid_keeps_speculation_off():
    """Eight new 300-token prompts at batch 8 with 60 tokens each to go: the draft's catch-up (about 2.4 s) is
    5 ms a token, more than any arm could save there, so nothing speculative is tried. At batch 1 a new
    prompt's catch-up is repaid and speculation is explored."""
    p = _lag_planner()
    for _ in range(300):
        p.note_draft_lag([300] * 8, [60] * 8)
        g = p.choose(8)
        assert g == 0
        p.observe(8, g, 0.06, 8, 0, 0)
    assert p.surcharge == pytest.approx(LAG_TABLE.catch_up([300] * 8) / 480)
    one = _lag_planner()
    seen = set()
    for _ in range(300):
        one.note_draft_lag([300], [200])
        g = one.choose(1)
        seen.add(g)
        one.observe(1, g, LAG_GRID["seconds"][0][g], g + 1, g, g)
    assert seen == {0, 1, 2}
    # In step, nothing to catch up: batch 8's arms are explored again.
    p.note_draft_lag([0] * 8, [60] * 8)
    assert p.surcharge == 0.0 and {p.choose(8) for _ in range(3000)} == {0, 1, 2}


def test_a_prompt_joining_mid_bin_turns_a_locked_speculative_arm_off_for_the_step():
    p = _lag_planner(seed=1)
    st_loss = {0: 0.0075, 1: 0.0070, 2: 0.0065}
    for _ in range(400):  # learn batch 8 in step: gamma 2 is best
        p.note_draft_lag([0] * 8, [200] * 8)
        g = p.choose(8)
        p.observe(8, g, st_loss[g] * 8, 8, 0, 0)
    st = p._state[8]
    while st.tau == 1 or st.current == 0:  # into a bin locked on a speculative arm
        p.note_draft_lag([0] * 8, [200] * 8)
        p.choose(8)
    p.note_draft_lag([0] * 7 + [770], [30] * 7 + [20])  # C(770, 1) = 0.77 s over the batch's last 230 tokens
    assert p.choose(8) == 0
    p.note_draft_lag([0] * 7 + [770], [200] * 8)  # over 1600 tokens to come it is repaid: the bin's arm stays
    assert p.choose(8) == st.current > 0
    p.note_draft_lag([0] * 8, [200] * 8)
    assert p.choose(8) == st.current > 0  # the bin's arm again once nothing lags


def test_a_step_far_slower_than_its_arm_is_clipped_in_the_mean():
    p = _nightjar(0)
    p.choose(8)
    for loss in (0.01, 0.011, 0.09, 0.012):
        p.observe(8, 0, loss * 10, 10, 0, 0)
    assert p.estimates()[8][0] == pytest.approx((0.01 + 0.011 + 4 * 0.0105 + 0.012) / 4) and p.outliers == 1
    # An arm that really became 5x slower is not stuck at its old mean: clipped steps still pull it up.
    p.choose(1)
    for loss in [0.0025] * 3 + [0.0125] * 100:
        p.observe(1, 0, loss, 1, 0, 0)
    assert p.estimates()[1][0] > 0.011
    paper = make_policy("nightjar_paper", 4)  # Algorithm 1 as printed keeps every loss as measured
    paper.choose(8)
    for loss in (0.01, 0.011, 0.09, 0.012):
        paper.observe(8, 0, loss * 10, 10, 0, 0)
    assert paper.estimates()[8][0] == pytest.approx(0.123 / 4) and paper.outliers == 0


def test_the_engine_tells_the_policy_what_the_draft_must_catch_up_on(models, prompt_ids, reference):
    from controller.colocated import colocated_engine
    from starjar.spec.policy import FixedGamma
    from starjar.spec.sampling import SamplingParams

    notes = []

    class Recording(FixedGamma):
        def note_draft_lag(self, behind, left):
            notes.append((list(behind), list(left)))

    engine = colocated_engine(models["llama"], models["draft"], 0, 4, policy=Recording(2))
    prompts = prompt_ids[:2]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [r.output_ids for r in reqs] == [r[:12] for r in reference("llama", 64)[:2]]
    # First decode step: the draft has seen neither prompt (each one's prompt and first token lag); it has 11
    # tokens to go. Then, speculating every step, nothing lags beyond a step's verified tokens.
    assert notes[0] == ([len(p) + 1 for p in prompts], [11, 11])
    assert all(b == [0] * len(b) for b, _ in notes[1:]) and len(notes) > 2

    class Alternating(Recording):  # speculate, two plain steps, speculate: the draft then lags those two tokens
        def __init__(self):
            super().__init__(0)
            self.plan = iter([2, 0, 0, 2, 2])

        def choose(self, batch_size):
            return next(self.plan, 2)

    notes.clear()
    engine = colocated_engine(models["llama"], models["draft"], 0, 4, policy=Alternating())
    reqs = engine.generate(prompts[:1], SamplingParams(max_tokens=12))
    assert reqs[0].output_ids == reference("llama", 64)[0][:12]
    assert [b[0] for b, _ in notes[:5]] == [len(prompts[0]) + 1, 0, 1, 2, 0]


def test_an_eliminated_arm_comes_back_when_it_becomes_the_best():
    """Elimination is not for good: a block's first bin tries every arm, so when acceptance rises and speculation
    starts to pay at a batch size where it lost, the planner moves to it."""
    from starjar.spec.policies.nightjar import NightjarPlanner

    p = NightjarPlanner(max_gamma=2, cswitch=CSwitchTable.zero(), seed=0)

    def run(steps, losses):
        picks = [0, 0, 0]
        for _ in range(steps):
            g = p.choose(8)
            picks[g] += 1
            p.observe(8, g, losses[g] * 10, 10, 0, 0)
        return picks

    first = run(20000, [0.0075, 0.01, 0.01])
    assert first[0] > 0.95 * sum(first)
    later = run(60000, [0.0075, 0.004, 0.004])
    assert later[1] + later[2] > 0.5 * sum(later), later
    assert run(5000, [0.0075, 0.004, 0.004])[0] < 500


def test_a_catch_up_is_priced_at_what_catch_ups_cost_here_when_the_profile_says_less():
    """Without a profile (serving) or with one that underprices it, the surcharge comes from this process's own
    measurements: the target's prefill until a draft catch-up has been measured, then the draft's."""
    from starjar.spec.policies.nightjar import CATCH_UP_MIN_TOKENS

    p = NightjarPlanner(2, seed=0)  # no profile: C_switch is zero
    p.note_draft_lag([300] * 8, [60] * 8)
    assert p.surcharge == 0.0
    p.observe_target_prefill(2400, 2.4)  # 1 ms a token
    p.note_draft_lag([300] * 8, [60] * 8)
    assert p.surcharge == pytest.approx(0.001 * 2400 / 480)
    p.observe_catch_up(CATCH_UP_MIN_TOKENS - 1, 5.0)  # a few tokens' proposing is mostly drafting: not counted
    p.note_draft_lag([300] * 8, [60] * 8)
    assert p.surcharge == pytest.approx(0.001 * 2400 / 480)
    p.observe_catch_up(1000, 0.5)  # the draft catches up at 0.5 ms a token: its own rate wins from now on
    p.note_draft_lag([300] * 8, [300] * 8)
    assert p.surcharge == pytest.approx(0.0005 * 2400 / (8 * 256))  # each row repays over at most 256 tokens
    # A profile that prices it higher keeps its price; one that prices it lower gives way to the measurement.
    q = _lag_planner()
    q.observe_catch_up(1000, 0.1)
    q.note_draft_lag([300] * 8, [60] * 8)
    assert q.surcharge == pytest.approx(LAG_TABLE.catch_up([300] * 8) / 480)
    q.observe_catch_up(1000, 9.9)  # now 5 ms a token over the 2000 measured
    q.note_draft_lag([300] * 8, [60] * 8)
    assert q.surcharge == pytest.approx(0.005 * 2400 / 480)
    assert q.surcharge > LAG_TABLE.catch_up([300] * 8) / 480


def test_measured_prefills_keep_a_flood_of_new_prompts_plain_without_a_profile():
    """Eight fresh 300-token prompts at batch 8 with 60 tokens each to go, and the target prefilled them at
    1 ms a token: the draft's catch-up would add 5 ms to every token to come, more than speculation saves per
    step (5 against 7.5 ms a token), so once each arm has been tried it runs plain. Without the measurement
    it speculates most of the time."""
    def run(prior: bool) -> list[int]:
        p = NightjarPlanner(2, seed=0)
        if prior:
            p.observe_target_prefill(2400, 2.4)
        chosen = []
        for _ in range(300):
            p.note_draft_lag([300] * 8, [60] * 8)
            g = p.choose(8)
            chosen.append(g)
            p.observe(8, g, 0.06 if g == 0 else 0.04 * (g + 1), 8 if g == 0 else 8 * (g + 1), 0, 0)
        return chosen

    priced = run(prior=True)
    assert sum(1 for g in priced if g) <= 3 and not any(priced[100:])
    assert sum(1 for g in run(prior=False)[100:] if g) > 100


def test_the_engine_reports_prefills_and_draft_catch_ups_to_the_policy(models, prompt_ids, reference):
    from controller.colocated import colocated_engine
    from starjar.spec.policy import FixedGamma, Overridable
    from starjar.spec.sampling import SamplingParams

    seen = {"prefill": [], "catch_up": []}

    class Recording(FixedGamma):
        def observe_target_prefill(self, tokens, seconds):
            seen["prefill"].append((tokens, seconds))

        def observe_catch_up(self, tokens, seconds):
            seen["catch_up"].append((tokens, seconds))

    engine = colocated_engine(models["llama"], models["draft"], 0, 4, policy=Overridable(Recording(2)))
    prompts = prompt_ids[:3]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert [r.output_ids for r in reqs] == [r[:8] for r in reference("llama", 64)[:3]]
    assert sum(t for t, _ in seen["prefill"]) == sum(map(len, prompts)) and all(s > 0 for _, s in seen["prefill"])
    # The first drafting step catches the draft up on every prompt and its first token.
    assert sum(t for t, _ in seen["catch_up"]) == sum(len(p) + 1 for p in prompts)
    assert len(seen["catch_up"]) == engine.stats.draft_prefill_steps
    # Timed by the in-process draft engine's own catch-up clock, not the whole proposing call (which drafts too).
    assert 0 < sum(s for _, s in seen["catch_up"]) <= engine.proposer.stats.catchup_s
    seen["prefill"].clear()
    colocated_engine(models["llama"], None, 0, 4, policy=Recording(0)).generate(prompts, SamplingParams(max_tokens=4))
    assert seen["prefill"] == []  # no draft, nothing to price


def test_a_failed_round_is_not_a_new_catch_up(models, prompt_ids, reference):
    """After a proposer failure every sequence is resent from its start, but the draft kept what it had: the
    resend is neither measured as a catch-up (it would make catch-ups look free) nor priced as one (the
    planner would then keep those requests plain for good)."""
    from controller.colocated import colocated_engine
    from starjar.spec.policy import FixedGamma
    from starjar.spec.sampling import SamplingParams

    seen = {"catch_up": [], "lag": []}

    class Recording(FixedGamma):
        def observe_catch_up(self, tokens, seconds):
            seen["catch_up"].append(tokens)

        def note_draft_lag(self, behind, left):
            seen["lag"].append(list(behind))

    engine = colocated_engine(models["llama"], models["draft"], 0, 4, policy=Recording(2))
    ask, calls = engine.proposer.propose, []

    def flaky(reqs):
        calls.append([r.start for r in reqs])
        if len(calls) == 3:
            raise RuntimeError("injected proposer failure")
        return ask(reqs)

    engine.proposer.propose = flaky
    prompts = prompt_ids[:2]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=16))
    assert [r.output_ids for r in reqs] == [r[:16] for r in reference("llama", 64)[:2]]
    assert engine.stats.proposer_failures == 1 and calls[3] == [0, 0]  # the round after it resent everything
    assert seen["catch_up"] == [sum(len(p) + 1 for p in prompts)]  # the prompts once, not the resend
    assert max(seen["lag"][3]) <= 4  # the step after the failure: what the draft lacks, not whole sequences
