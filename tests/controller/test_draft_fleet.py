"""The controller's draft-server state (controller/fleet/fleet.py) and its metrics, without Ray."""

from __future__ import annotations

import asyncio
import socket

from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

from controller.cluster.metrics import fleet_metrics
from controller.fleet.fleet import DraftFleet, refused

FP = "49152:abc"


def _fleet(m: int = 2, targets: int = 4, n_max: int = 8) -> tuple[DraftFleet, dict, dict]:
    fleet = DraftFleet(lambda name: object(), n_max, [f"starjar-target-{i}" for i in range(targets)])
    for i in range(m):
        fleet.add(i)
    info = {n: {"address": f"127.0.0.1:{9000 + k}", "fingerprint": FP} for k, n in enumerate(fleet.handles)}
    info.update({t: {"fingerprint": FP} for t in fleet.assignment.of})
    live = {n: True for n in fleet.handles}
    fleet.observe(info, live)
    fleet.settle()
    return fleet, info, live


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_targets_are_spread_and_addresses_published():
    fleet, info, _ = _fleet()
    assert list(fleet.handles) == ["starjar-draft", "starjar-draft-1"]
    assert [fleet.assignment.count(n) for n in fleet.handles] == [2, 2]
    t = fleet.assignment.attached("starjar-draft-1")[0]
    assert fleet.address_for(t, info) == info["starjar-draft-1"]["address"]
    assert fleet.next_index() == 2


def test_a_lost_stream_to_a_dead_port_moves_that_servers_targets_at_once():
    fleet, info, live = _fleet()
    info["starjar-draft-1"]["address"] = f"127.0.0.1:{_free_port()}"  # nothing listens there
    t = fleet.assignment.attached("starjar-draft-1")[0]
    moves = asyncio.run(fleet.lost(t, info["starjar-draft-1"]["address"], info, live))
    assert moves == []  # the movers' streams broke: nobody needs telling
    assert live["starjar-draft-1"] is False and fleet.assignment.count("starjar-draft") == 4
    assert fleet.address_for(t, info) == info["starjar-draft"]["address"]
    assert fleet.moves["failover"] == 2


def test_a_lost_stream_to_a_live_server_moves_nothing():
    fleet, info, live = _fleet()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        info["starjar-draft-1"]["address"] = f"127.0.0.1:{s.getsockname()[1]}"
        assert not asyncio.run(refused(info["starjar-draft-1"]["address"]))
        t = fleet.assignment.attached("starjar-draft-1")[0]
        asyncio.run(fleet.lost(t, info["starjar-draft-1"]["address"], info, live))
    assert live["starjar-draft-1"] and fleet.assignment.count("starjar-draft-1") == 2


def test_fleet_metrics_say_who_serves_whom_and_who_has_none():
    fleet, info, live = _fleet(m=2, targets=5, n_max=2)
    reg = CollectorRegistry()

    class _C:
        def collect(self):
            return fleet_metrics(fleet)

    reg.register(_C())
    text = generate_latest(reg).decode()
    assert 'starjar_controller_draft_assigned_targets{draft="starjar-draft"} 2.0' in text
    assert "starjar_controller_targets_without_draft 1.0" in text
    assert 'starjar_controller_draft_assignments_total{draft="starjar-draft-1"} 2.0' in text
    assert 'starjar_controller_draft_reassignments_total{reason="failover"} 0.0' in text
