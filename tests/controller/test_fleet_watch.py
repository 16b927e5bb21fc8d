"""N_full, N_max and the saturation guard per draft server of the fleet (controller/fleet/watch.py).

Two draft servers: the first idle (Z large against S, its targets gain from speculation), the second
saturated (busy 99% of the window, its targets' speculative steps slower than plain ones). Only the
second's targets lose speculation and only the second's N_max falls; a target moved between the two
follows its new server's verdict. Before this, the controller sampled the first draft server only and
applied its verdict to every target."""

from __future__ import annotations

import asyncio

from controller.cluster.metrics import per_draft_metrics
from controller.cluster.spec import ClusterSpec
from controller.fleet.fleet import DraftFleet
from controller.fleet.saturation import SaturationGuard
from controller.fleet.watch import FleetWatch

D0, D1 = "starjar-draft", "starjar-draft-1"
TARGETS = [f"starjar-target-{i}" for i in range(4)]
CAP = 8


def _draft_snap(t: float, rounds: int, busy: float, service: float, wait: float, per_target: dict) -> dict:
    return {"uptime_s": t, "rounds": rounds, "busy_s": busy, "idle_s": t - busy, "mean_service_s": service,
            "mean_wait_s": wait, "targets": [{"worker_id": w, "rounds": r} for w, r in per_target.items()]}


def _draft_snaps() -> dict[str, list[dict]]:
    """Three samples 5 s apart. D0: 50 rounds per window of S 20 ms, busy 10%: Z = 5 s / 25 - 20 ms = 180 ms,
    N_full 10. D1: 40 rounds of S 100 ms and 100 ms queueing, busy 99%: Z = 50 ms, N_full 2."""
    t0, t1 = TARGETS[:2], TARGETS[2:]
    d0 = [_draft_snap(5 * k + 5, 50 * k, 0.5 * k + 0.5, 0.02, 0.0, {w: 25 * k for w in t0}) for k in range(3)]
    d1 = [_draft_snap(5 * k + 5, 40 * k, 4.95 * k + 0.05, 0.1, 0.1, {w: 20 * k for w in t1}) for k in range(3)]
    return {D0: d0, D1: d1}


def _target(spec_tokens: int, spec_steps: int, spec_s: float, plain_tokens: int, plain_s: float) -> dict:
    return {"spec_tokens": spec_tokens, "spec_steps": spec_steps, "spec_step_s": spec_s, "fallback_tokens": 0,
            "fallback_step_s": 0.0, "plain_tokens": plain_tokens, "plain_step_s": plain_s}


def _target_stats(k: int) -> dict:
    """Cumulative, k windows in: D0's targets speculate at 25 tokens/s (3 per round), D1's at 8 (1.2 per
    round); both decode 10 tokens/s plain."""
    fast, slow = _target(150 * k, 50 * k, 6.0 * k, 10 * k, 1.0 * k), _target(40 * k, 33 * k, 5.0 * k, 10 * k, 1.0 * k)
    return {t: dict(fast if i < 2 else slow) for i, t in enumerate(TARGETS)}


def _assignment() -> dict[str, str | None]:
    return {t: D0 if i < 2 else D1 for i, t in enumerate(TARGETS)}


def _watch() -> FleetWatch:
    return FleetWatch(CAP, admission_auto=True, make_guard=lambda: SaturationGuard(hold_s=30.0))


def _step(watch: FleetWatch, k: int, assignment: dict, now: float | None = None, n_maxes: dict | None = None):
    snaps = _draft_snaps()
    pairs = {d: (s[k - 1], s[k]) for d, s in snaps.items()}
    return watch.step(5.0 * k if now is None else now, pairs, _target_stats(k), assignment,
                      n_maxes or {D0: CAP, D1: CAP}, override=None)


def test_the_second_server_saturated_stops_only_its_own_targets():
    watch, assignment = _watch(), _assignment()
    first = _step(watch, 1, assignment)  # the first window: the targets' counters start here
    assert first.gamma == {}
    plan = _step(watch, 2, assignment)
    assert plan.gamma == {TARGETS[2]: 0, TARGETS[3]: 0}  # D1's targets held at gamma 0, D0's untouched
    assert watch.forcing(D1) and not watch.forcing(D0)
    assert watch.servers[D0].estimate[2] == 10 and watch.servers[D1].estimate[2] == 2  # N_full per server
    # N_max per server: D0's targets gain (3 tokens per 200 ms cycle vs 10 tokens/s alone): it stays at the cap;
    # D1's lose even alone on it (1.2 tokens per 150 ms = 8 tokens/s < 10): it admits 1.
    assert plan.n_max == {D1: 1}


def test_a_moved_target_follows_its_new_servers_verdict_and_the_hold_ends():
    watch, assignment = _watch(), _assignment()
    _step(watch, 1, assignment)
    _step(watch, 2, assignment)
    assignment[TARGETS[3]], assignment[TARGETS[0]] = D0, D1  # a rebalance swaps one each way
    plan = watch.step(11.0, {}, None, assignment, {D0: CAP, D1: 1}, override=None)
    # The moved target follows; the one still held is told again (a lost call or a restart must not end a hold).
    assert plan.gamma == {TARGETS[3]: None, TARGETS[0]: 0, TARGETS[2]: 0}
    assert watch.forced == {TARGETS[0], TARGETS[2]}
    release = _step(watch, 2, assignment, now=10.0 + 30.0, n_maxes={D0: CAP, D1: 1})
    assert release.gamma == {TARGETS[0]: None, TARGETS[2]: None} and not watch.forced


def test_a_users_gamma_keeps_every_guard_out():
    watch, assignment = _watch(), _assignment()
    _step(watch, 1, assignment)
    _step(watch, 2, assignment)
    watch.cancel()
    plan = watch.step(12.0, {}, None, assignment, {D0: CAP, D1: CAP}, override=3)
    assert plan.gamma == {} and not watch.forced and not watch.forcing(D1)


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)
        return call()


class _Draft:
    """A draft server actor's stats and set_max_targets, answering from recorded snapshots."""

    def __init__(self, snaps: list[dict]):
        self.snaps, self.k, self.n_max_set = snaps, 0, []
        self.stats = _Call(lambda: self.snaps[self.k])
        self.set_max_targets = _Call(self.n_max_set.append)


class _TargetActor:
    def __init__(self, name: str, clock: list[int]):
        self.gammas: list[int | None] = []
        self.stats = _Call(lambda: _target_stats(clock[0])[name])
        self.set_gamma = _Call(self.gammas.append)


def _controller(watch: FleetWatch):
    """A Controller with only its watch and fleet (no Ray actors behind it) over two recorded draft servers;
    returns it, the draft servers, the fleet and a function that runs one sampling k."""
    from controller.cluster.controller_actor import Controller

    snaps, clock = _draft_snaps(), [0]
    drafts = {D0: _Draft(snaps[D0]), D1: _Draft(snaps[D1])}
    fleet = DraftFleet(lambda name: drafts[name], CAP, TARGETS)
    fleet.add(0)
    fleet.add(1)
    fleet.observe({d: {"fingerprint": "fp"} for d in drafts}, {d: True for d in drafts})
    fleet.assignment.of.update(_assignment())  # (placement alternates; this split keeps the snapshots' targets)
    assert fleet.settle() == []
    ctl = Controller.__new__(Controller)
    ctl.fleet, ctl.watch, ctl.override, ctl._override_due = fleet, watch, None, set()
    ctl.spec = ClusterSpec(target="target", draft="draft", policy="nightjar")
    ctl.targets = {t: _TargetActor(t, clock) for t in TARGETS}

    async def sample(k: int) -> None:
        clock[0] = k
        for d in drafts.values():
            d.k = k
        await ctl._watch_fleet(await fleet.sample_loads())

    return ctl, drafts, fleet, sample


def test_the_controller_samples_every_draft_server_and_acts_per_server():
    """The controller's own sampling (DraftFleet.sample_loads -> Controller._watch_fleet) over two servers."""
    ctl, drafts, fleet, sample = _controller(_watch())
    for k in range(3):
        asyncio.run(sample(k))
    assert [ctl.targets[t].gammas for t in TARGETS] == [[], [], [0], [0]]
    assert drafts[D0].n_max_set == [] and drafts[D1].n_max_set == [1]
    assert fleet.slots[D1].n_max == 1 and fleet.slots[D0].n_max == CAP
    assert round(fleet.slots[D1].load, 2) == 0.99 and round(fleet.slots[D0].load, 2) == 0.1
    assert ctl.policy_name() == "nightjar"  # two targets still speculate
    samples = {(m.name, s.labels.get("draft")): s.value for m in per_draft_metrics(fleet, ctl.watch)
               for s in m.samples}
    assert samples[("starjar_controller_saturation_forced", D1)] == 1
    assert samples[("starjar_controller_saturation_forced", D0)] == 0
    assert samples[("starjar_controller_n_full", D0)] == 10 and samples[("starjar_controller_n_max", D1)] == 1


def test_n_full_is_estimated_with_fixed_admission_and_no_guard():
    """The defaults (fixed N_max, --no-saturation-guard): nothing is acted on, but every draft server's N_full is
    still estimated for status and metrics."""
    ctl, drafts, _, sample = _controller(FleetWatch(CAP, admission_auto=False, make_guard=None))
    for k in range(3):
        asyncio.run(sample(k))
    assert ctl.watch.servers[D0].estimate[2] == 10 and ctl.watch.servers[D1].estimate[2] == 2
    assert all(ctl.targets[t].gammas == [] for t in TARGETS)
    assert drafts[D0].n_max_set == [] and drafts[D1].n_max_set == []


def test_a_draft_server_with_no_round_in_the_window_is_measured_idle():
    """Its loop books an idle gap only when the next round comes: no round at all must read load 0, not the last
    busy window's load (which kept a drained fleet from ever retiring a server)."""
    busy = _draft_snaps()[D1][:2]
    quiet = dict(busy[1], uptime_s=busy[1]["uptime_s"] + 5.0)
    draft = _Draft([*busy, quiet])
    fleet = DraftFleet(lambda name: draft, CAP, TARGETS)
    fleet.add(0)
    fleet.observe({D0: {"fingerprint": "fp"}}, {D0: True})
    loads = []
    for k in range(3):
        draft.k = k
        asyncio.run(fleet.sample_loads())
        loads.append(round(fleet.slots[D0].load, 2))
    assert loads == [0.0, 0.99, 0.0]


class _Hung:
    """A call to an actor Ray is restarting (max_restarts=-1): it neither answers nor fails."""

    def remote(self, *args):
        return asyncio.Event().wait()


def test_a_target_being_restarted_holds_up_neither_the_loop_nor_a_users_gamma(monkeypatch):
    """Before, one target whose calls hung (being restarted, or waiting for a node) stopped the controller's
    loop at its set_gamma, blinded every draft server's admission and guard (the whole stats sample timed out),
    and hung a user's set_gamma. Now each call is bounded: the others are sampled and told as before, and the
    user's gamma reaches the hung target once it answers."""
    import controller.cluster.controller_actor as ca

    monkeypatch.setattr(ca, "INFO_TIMEOUT_S", 0.2)
    monkeypatch.setattr(ca, "STATS_TIMEOUT_S", 0.2)
    ctl, drafts, fleet, sample = _controller(_watch())
    hung = ctl.targets[TARGETS[0]]
    real_stats, real_set = hung.stats, hung.set_gamma
    hung.stats = hung.set_gamma = _Hung()
    for k in range(3):
        asyncio.run(asyncio.wait_for(sample(k), 5))
    assert [ctl.targets[t].gammas for t in TARGETS[1:]] == [[], [0], [0]]  # as with every target answering
    assert drafts[D1].n_max_set == [1]  # admission still acted on the others' stats
    asyncio.run(asyncio.wait_for(ctl.set_gamma(2), 5))
    assert ctl._override_due == {TARGETS[0]} and all(ctl.targets[t].gammas[-1] == 2 for t in TARGETS[1:])
    hung.stats, hung.set_gamma = real_stats, real_set  # it is back
    asyncio.run(asyncio.wait_for(sample(2), 5))  # (the recordings hold three samples: the last again)
    assert hung.gammas[-1] == 2 and not ctl._override_due
