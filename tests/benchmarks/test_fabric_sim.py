"""The star simulator (benchmarks/sims/fabric_sim.py): pass-level scheduling as draft_server/compute.py
does it, hand-computed small cases, and StarSD's closed forms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.sims.fabric_sim import (
    Hosts,
    PassCost,
    Round,
    StarModel,
    _Draft,
    _Job,
    assign,
    drafts_needed,
    iteration_cost,
    n_full,
    service_s,
    simulate,
)

P, Z, TAU, G = 0.0025, 0.025, 3.0, 4  # one-row pass, return time, tokens per round, gamma: S = 4 P = 0.010


def _model(**kw) -> StarModel:
    kw.setdefault("cost", PassCost([(1, P)]))
    return StarModel(z_s=Z, tokens_per_round=TAU, plain_step_s=0.02, gamma=G, **kw)


def test_one_target_cycles_in_z_plus_s():
    out = simulate(_model(wake_s=0.002), 1, 1, cycles=400)
    s = G * P + 0.002
    assert out["system_tokens_per_s"] == pytest.approx(TAU / (Z + s), rel=0.02)
    assert out["draft_load"] == pytest.approx(s / (Z + s), rel=0.02)


def test_a_batched_pass_serves_rows_of_two_targets():
    # Two targets sending at 0: the first round starts a pass alone (the server was idle), the second joins
    # the next pass: passes of 1, 2, 2, 2, 1 rows = 1 + 3 x 1.5 + 1 = 6.5 s for 2 rounds. fifo runs 4 one-row
    # passes for the first, then 4 for the second: 8 s.
    cost = PassCost([(1, 1.0), (2, 1.5)])
    both = [Round(G, 3)] * 100
    batched = simulate(_model(cost=cost, mode="batched", scripts=[both]), 2, 1, duration_s=1.0, together=True)
    assert batched["rows_per_pass"] == pytest.approx(8 / 5) and batched["passes_per_round"] == pytest.approx(2.5)
    assert batched["busy_per_round_s"] == pytest.approx(6.5 / 2)
    fifo = simulate(_model(cost=cost, scripts=[both]), 2, 1, duration_s=1.0, together=True)
    assert fifo["rows_per_pass"] == pytest.approx(1.0) and fifo["busy_per_round_s"] == pytest.approx(4.0)


def test_load_accounting_of_a_hand_computed_run():
    # One target, rounds of 2 passes at 1 s plus 0.5 s bookkeeping, Z = 2 s, stop after 5 s:
    # round 1 at [0, 2.5], next send 4.5 (< 5): round 2 at [4.5, 7], next send 9 >= 5: wall 9,
    # busy 5 s, tokens 2 x 3.
    m = StarModel(z_s=2.0, tokens_per_round=3, plain_step_s=1.0, cost=PassCost([(1, 1.0)]), gamma=2, round_s=0.5)
    out = simulate(m, 1, 1, duration_s=5.0, together=True)
    assert out["wall_s"] == pytest.approx(9.0) and out["rounds"] == 2
    assert out["draft_load"] == pytest.approx(5.0 / 9.0)
    assert out["system_tokens_per_s"] == pytest.approx(6.0 / 9.0)


def test_a_late_round_joins_the_next_pass_and_a_prompt_gets_its_own_pass():
    m = _model(cost=PassCost([(1, 1.0), (4, 2.5)]), prefill=PassCost([(10, 3.0), (100, 12.0)]), mode="batched")
    dr = _Draft()
    dr.active = [_Job(0, Round(G, 3), G - 2, fresh=False), _Job(1, Round(G, 3, prefill=40), G),
                 _Job(2, Round(G, 3), G)]
    cost, done = iteration_cost(m, dr, taken=2)
    # The two short rows (one mid-way, one new) share one pass (step(2) = 1.5); the 40-token prompt its own
    # (prefill(40) = 6.0): two passes in this iteration, nobody finished yet.
    assert cost == pytest.approx(1.5 + 6.0) and dr.passes == 2 and done == []
    cost, done = iteration_cost(m, dr, taken=0)
    assert cost == pytest.approx(2.0) and [j.target for j in done] == [0]  # step(3), the first is done


def test_fifo_saturates_at_n_full_and_a_second_draft_doubles_it():
    m = _model()
    assert service_s(m) == pytest.approx(0.010) and n_full(m) == 4
    one = simulate(m, 8, 1, cycles=400)
    assert one["system_tokens_per_s"] == pytest.approx(TAU / 0.010, rel=0.02) and one["draft_load"] > 0.99
    two = simulate(m, 8, 2, cycles=400)
    assert two["system_tokens_per_s"] == pytest.approx(2 * TAU / 0.010, rel=0.02)


def test_batched_passes_serve_more_rounds_per_second():
    m = _model(mode="batched", cost=PassCost([(1, P), (8, 2 * P)]))
    assert PassCost([(1, P), (8, 2 * P)])(4) == pytest.approx(P + 3 * P / 7)
    fifo = simulate(_model(), 16, 1, cycles=200)["system_tokens_per_s"]
    assert simulate(m, 16, 1, cycles=200)["system_tokens_per_s"] > 2 * fifo


def test_targets_past_n_max_decode_alone():
    m = _model(n_max=3)
    assert sum(d is None for d in assign(8, 2, 3).values()) == 2
    out = simulate(m, 8, 2, cycles=400)
    assert out["without_draft"] == 2
    assert out["system_tokens_per_s"] == pytest.approx(2 * 3 * TAU / max(Z + 0.01, 3 * 0.01) + 2 / 0.02, rel=0.03)


def test_drafts_needed_follows_n_full():
    m = _model()
    need = drafts_needed(m, 64, share=0.9)
    assert 64 / n_full(m) <= need <= 64 / (n_full(m) - 2)


def test_scripts_give_each_target_its_rounds_in_turn():
    # A request of a prompt round (2 passes) and a last round with nothing to draft (0 passes, 1 token).
    script = [Round(2, 3, prefill=20), Round(0, 1)]
    m = StarModel(z_s=1.0, tokens_per_round=0, plain_step_s=1.0, cost=PassCost([(1, 1.0)]), gamma=2,
                  prefill=PassCost([(20, 4.0)]), scripts=[script])
    out = simulate(m, 1, 1, duration_s=7.0, together=True)
    # [0, 5]: prompt pass 4 + step 1; send 6: the 0-pass round is answered at once (no pass); send 7 >= 7.
    assert out["rounds"] == 2 and out["wall_s"] == pytest.approx(7.0)
    assert out["system_tokens_per_s"] == pytest.approx(4 / 7.0) and out["draft_load"] == pytest.approx(5 / 7.0)


def test_calibration_takes_the_measured_costs_and_the_workload():
    from benchmarks.fabric import admitted, calibrate, this_host

    costs = {"step": [(1.0, P), (4.0, 2 * P)], "prefill": [(10.0, 0.01), (50.0, 0.03)], "round_s": 0.0,
             "scripts": [[{"passes": G, "tokens": 4, "prefill": 20}, {"passes": G, "tokens": 2, "prefill": 0}]],
             "batched_scripts": {"1": [[{"passes": G, "tokens": 4}]], "4": [[{"passes": G, "tokens": 2}]]},
             "contention": {"slowdown": [1.0, 1.7]}}
    m = calibrate(costs, "fifo", Z, plain_step_s=0.02)
    assert (m.z_s, m.cost(1), m.cost(4), m.prefill(30), m.tokens_per_round) == pytest.approx(
        (Z, P, 2 * P, 0.02, 3.0))
    assert service_s(m) == pytest.approx(0.010) and m.hosts == Hosts()  # a projection: a host per server
    # Admission: speculating beats 50 tokens/s alone only while tau / (N S) > 50, i.e. N < 6.
    assert admitted(m).n_max == 5
    # The batched mode drafts with the workload of the most targets per server up to the row's (1 up to 3).
    assert [calibrate(costs, "batched", Z, 0.02, per_server=k).tokens_per_round for k in (1, 3, 4, 8)] == [
        4, 4, 2, 2]
    assert this_host(costs, 2).per_host == 2 and this_host(costs, 2).slowdown(2) == 1.7


def test_servers_sharing_a_host_slow_each_other_while_both_are_busy():
    # Two servers on one host, a pass 1 s alone, 2 s while both are busy. Targets 0 and 1 (one per server)
    # send at 0: round of 1 pass (server 0) and of 3 passes (server 1). Both at half speed until 2 (server 0
    # done: 1 s of work), then server 1 alone: its 2 s left end at 4. Z = 1, stop 0.5: sends at 3 and 5 end it.
    scripts = [[Round(1, 2)], [Round(3, 2)]]
    shared = StarModel(z_s=1.0, tokens_per_round=0, plain_step_s=1.0, cost=PassCost([(1, 1.0)]), gamma=1,
                       scripts=scripts, hosts=Hosts(per_host=2, cores=2, contention=(1.0, 2.0)))
    assert assign(2, 2, 64) == {"t0": "d0", "t1": "d1"}
    out = simulate(shared, 2, 2, duration_s=0.5, together=True)
    assert out["wall_s"] == pytest.approx(5.0) and out["rounds"] == 2
    assert out["loads"] == pytest.approx([2 / 5, 4 / 5]) and out["busy_per_round_s"] == pytest.approx(3.0)
    assert out["system_tokens_per_s"] == pytest.approx(4 / 5)
    # A host each (the projection's servers): 1 s and 3 s, sends at 2 and 4, wall 4.
    apart = simulate(replace(shared, hosts=Hosts()), 2, 2, duration_s=0.5, together=True)
    assert apart["wall_s"] == pytest.approx(4.0) and apart["loads"] == pytest.approx([1 / 4, 3 / 4])


def test_a_host_of_saturated_servers_serves_at_the_measured_slowdown():
    # fifo, 8 targets on 2 servers of one host, always both busy: each round 4 passes x P x 1.5.
    m = _model(hosts=Hosts(per_host=2, cores=2, contention=(1.0, 1.5)))
    out = simulate(m, 8, 2, duration_s=4.0, together=True)
    assert out["busy_per_round_s"] == pytest.approx(1.5 * G * P, rel=0.02)
    assert out["system_tokens_per_s"] == pytest.approx(2 * TAU / (1.5 * G * P), rel=0.03)
    assert simulate(_model(), 8, 2, duration_s=4.0, together=True)["busy_per_round_s"] == pytest.approx(G * P)


def test_host_slowdown_past_the_measured_servers_time_shares_the_cores():
    h = Hosts(per_host=4, cores=2, threads=1, contention=(1.0, 1.1))
    assert [h.slowdown(k) for k in (1, 2, 3, 4)] == pytest.approx([1.0, 1.1, 1.5, 2.0])
    assert [h.host(d) for d in range(6)] == [0, 0, 0, 0, 1, 1]
    assert Hosts(per_host=4, cores=8, contention=(1.0, 1.2)).slowdown(4) == pytest.approx(1.2)


def test_a_short_pass_is_padded_to_its_widest_row():
    # step(b) = b, catchup(b) over rows of 3 tokens = 2b: width w costs b (1 + (w - 1) / 2).
    m = _model(cost=PassCost([(1, 1.0), (8, 8.0)]), catchup=PassCost([(1, 2.0), (8, 16.0)]), catchup_width=3,
               mode="batched")
    assert [m.short_pass(4, w) for w in (1, 3, 5)] == pytest.approx([4.0, 8.0, 12.0])
    dr = _Draft()
    dr.active = [_Job(0, Round(G, 3), G - 1, fresh=False), _Job(1, Round(G, 3, feed=5), G)]
    cost, _ = iteration_cost(m, dr, taken=1)
    assert cost == pytest.approx(m.short_pass(2, 5)) == pytest.approx(6.0)
    fifo = replace(m, mode="fifo")
    dr = _Draft()
    dr.active = [_Job(0, Round(G, 3, feed=3), G)]
    assert iteration_cost(fifo, dr, taken=1)[0] == pytest.approx(2.0 + (G - 1) * 1.0)


def test_bench_star_refuses_draft_threads_out_of_range(tmp_path, capsys):
    from benchmarks.cli import main

    out = tmp_path / "star.json"
    assert main(["star", "--replay", "--draft-servers", "2", "--draft-threads", "0", "--out", str(out)]) == 2
    assert "draft_threads" in capsys.readouterr().err and not out.exists()


def test_batched_dry_replay_drafts_in_shared_passes_and_loses_no_token(models):
    from benchmarks.fabric_batched import batched_rounds, batched_workloads
    from benchmarks.fabric_costs import workload
    from benchmarks.fixtures.reference import hf_greedy
    from draft_server.engine import DraftEngine

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100, 101, 102], [42] * 12, [7, 3, 9]]
    scripts = [(p, hf_greedy(models["llama"], p, 10)) for p in prompts]
    engine = DraftEngine(models["draft"])
    single, _ = workload(engine, scripts, G)
    # One target: every pass has one row, as the single-row dry replay's: the same rounds.
    assert batched_rounds(engine, scripts, G, 1, PassCost([(1, P)]), Z) == single
    engine.stats.passes = engine.stats.drafted_tokens = 0
    by_n = batched_workloads(engine, scripts, G, single, PassCost([(1, P), (8, 2 * P)]), Z, sizes=(3,))
    assert set(by_n) == {1, 3} and by_n[1] is single
    # A one-row pass drafts at most one token: more drafts than passes, rows shared passes.
    assert engine.stats.drafted_tokens > engine.stats.passes
    for (_, continuation), rounds in zip(scripts, by_n[3], strict=True):
        # The replay verifies against the target's own greedy continuation: every token once, none lost.
        assert sum(r.tokens for r in rounds) == len(continuation)
        assert all(0 <= r.passes <= G and 1 <= r.feed <= 8 for r in rounds)


@pytest.mark.slow
def test_contention_times_draft_servers_busy_at_once(model_dirs, models):
    from benchmarks.fabric_contention import contention
    from benchmarks.fixtures.reference import hf_greedy

    scripts = [(p, hf_greedy(models["llama"], p, 12)) for p in ([5, 6, 7, 8], [100, 101, 102])]
    out = contention(str(model_dirs["draft"]), scripts, models["llama"].fingerprint, servers=2, seconds=1.0)
    assert len(out["pass_s_alone"]) == 2 and len(out["loads_together"]["2"]) == 2
    assert all(s > 0 for s in out["pass_s_alone"] + [out["pass_s_together"]["2"]])
    assert out["slowdown"][0] == 1.0 and out["slowdown"][1] > 0.5


def test_a_rounds_first_pass_feeds_what_the_drafts_kv_lacks():
    """The draft's KV holds its own drafts but the last, so after a full accept of gamma 3 (4 new tokens) the
    catch-up feeds 2, after a partial one 1; a sequence seen first feeds its prompt in a pass of its own."""
    from benchmarks.fabric_costs import as_round
    from starjar.spec.proposer import DraftRequest

    assert as_round(DraftRequest(1, 40, [5, 6, 7, 8], 3), 4).feed == 2
    assert as_round(DraftRequest(1, 40, [5, 6], 3), 2).feed == 1
    assert as_round(DraftRequest(1, 40, [5], 3), 1).feed == 1
    prompt = as_round(DraftRequest(1, 0, list(range(30)), 3), 3)
    assert (prompt.prefill, prompt.feed) == (30, 1)
    assert as_round(DraftRequest(1, 0, [1, 2, 3], 3), 3).feed == 3  # a short resync feeds all it has
