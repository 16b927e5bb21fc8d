"""Failover: one of two draft servers SIGKILLed while 4 targets serve 50 requests each on a local
`starjar up --draft-servers 2` cluster: nothing lost, nothing altered (equal to the target alone), its targets
speculating again on the other draft server within 2 s of the kill, and rebalanced when it returns."""

from __future__ import annotations

import time

import pytest
from fleet_load import DRAFTS, TARGETS, kill_one_draft_under_load, status
from local_cluster import up_cluster

pytestmark = pytest.mark.chaos


@pytest.fixture(scope="module")
def fleet(model_dirs, tmp_path_factory):
    with up_cluster(tmp_path_factory, "--target", model_dirs["llama"], "--draft", model_dirs["draft"],
                    "--targets", str(TARGETS), "--draft-servers", "2", "--gamma", "3",
                    "--batch-size", "4") as running:
        yield running


def _wait_rebalanced(controller, old_pid: int) -> dict:
    deadline = time.time() + 120
    while time.time() < deadline:
        st = status(controller)
        back = st["actors"][DRAFTS[1]]
        counts = [len(st["drafts"]["servers"][d]["attached"]) for d in DRAFTS]
        if back["live"] and back["pid"] != old_pid and counts == [2, 2]:
            return st
        time.sleep(0.2)
    raise AssertionError(f"not rebalanced: {status(controller)['drafts']}")


def test_one_of_two_draft_servers_killed_loses_nothing_and_moves_its_targets(fleet, prompt_ids, reference):
    addrs, controller = fleet
    st = status(controller)
    assert [len(st["drafts"]["servers"][d]["attached"]) for d in DRAFTS] == [2, 2]  # least attached: 2 and 2
    run = kill_one_draft_under_load(addrs, controller, prompt_ids, reference,
                                    while_running=lambda old_pid: _wait_rebalanced(controller, old_pid))
    rebalanced = run.while_running
    print(f"{run.requests} requests, 1 of 2 draft servers killed: lost {run.lost}, altered {run.altered}, "
          f"moved {sorted(run.moved)} in s { {t: round(s, 3) for t, s in run.took.items()} }, "
          f"moves {rebalanced['drafts']['moves']}")
    assert not run.errors and run.lost == 0 and run.altered == 0
    assert max(run.took.values()) <= 2.0
    assert run.speculating_after  # on the survivor
    assert rebalanced["drafts"]["moves"].get("failover", 0) >= 2
    assert rebalanced["drafts"]["moves"].get("rebalance", 0) >= 2
