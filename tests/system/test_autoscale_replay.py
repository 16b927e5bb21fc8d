"""Autoscaling with replay targets: real draft server processes, real streams, replay targets
(target_worker/replay.py) assigned by the controller's DraftFleet and scaled by its Autoscaler, driven by the
controller's poll in miniature (the actor handles are adapters over the processes: no Ray here).

4 targets, N_max 2, --autoscale-drafts 1..2: two targets wait, a second draft server is added and they
speculate on it; N_max then rises to 4 with the servers lightly loaded, the second is drained (its targets
move to the first and speculate there) and stopped. (A replay target emits its recorded continuation by
construction: what is checked here is who speculates where, not output equality.)"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from benchmarks.launch import ServerProcess
from controller.fleet.autoscale import Autoscaler
from controller.fleet.fleet import DraftFleet
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.remote.client import RemoteProposer
from target_worker.replay import ReplayTarget

pytestmark = pytest.mark.slow
N_TARGETS, N_MAX = 4, 2


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self):
        return asyncio.to_thread(self.fn)


class _DraftProcess:
    """A draft server process behind the two calls the fleet makes on an actor handle."""

    def __init__(self, model_dir: str, fingerprint: str):
        self.proc = ServerProcess("draft", "--model", model_dir, "--port", "0", "--max-targets", "8")
        self.address, self.fingerprint = self.proc.address, fingerprint
        self.stats = _Call(self._stats)

    def _stats(self) -> dict:
        with grpc.insecure_channel(self.address) as ch:
            msg = pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)
        return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class _Target:
    def __init__(self, proposer: RemoteProposer):
        self.follow_draft = _Call(proposer.follow)


async def _poll(fleet: DraftFleet, scaler: Autoscaler, targets: dict, info: dict) -> None:
    """One controller poll: who is live, place and rebalance, tell movers, measure, scale."""
    live = {n: h.proc.proc.poll() is None for n, h in fleet.handles.items()}
    info.clear()
    info.update({n: {"address": h.address, "fingerprint": h.fingerprint} for n, h in fleet.handles.items()})
    fleet.observe(info, live)
    await fleet.follow(fleet.settle(), targets)
    await fleet.sample_loads()
    await scaler.step(fleet)


def _until(loop, fleet, scaler, targets, info, cond, timeout=60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        loop.run_until_complete(_poll(fleet, scaler, targets, info))
        if cond():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out: {fleet.view()}")


def test_autoscale_adds_then_retires_a_draft_server(models, model_dirs, prompt_ids, reference):
    fp = models["llama"].fingerprint
    conts = reference("llama", 64)
    scripts = list(zip(prompt_ids, conts, strict=True))
    names = [f"starjar-target-{i}" for i in range(N_TARGETS)]
    fleet = DraftFleet(lambda name: _DraftProcess(model_dirs["draft"], fp), N_MAX, names)
    stopped = []

    async def stop(name, handle):
        handle.proc.kill()
        stopped.append(name)

    scaler = Autoscaler(1, 2, stop, cooldown_s=0.0, keep=("starjar-draft",))
    fleet.add(0)
    info: dict = {}
    proposers = {n: RemoteProposer(lambda n=n: fleet.address_for(n, info), fp, n, deadline_s=5.0) for n in names}
    handles = {n: _Target(p) for n, p in proposers.items()}
    replays = {n: ReplayTarget(p, 3, 0.05) for n, p in proposers.items()}
    done = threading.Event()

    def serve(n, k):  # one request after another
        while not done.is_set():
            replays[n].run([scripts[k % len(scripts)]])
            k += 1

    threads = [threading.Thread(target=serve, args=(n, i), daemon=True) for i, n in enumerate(names)]
    [t.start() for t in threads]
    loop = asyncio.new_event_loop()
    try:
        _until(loop, fleet, scaler, handles, info,
               lambda: len(fleet.slots) == 2 and all(p.attached for p in proposers.values()))
        assert scaler.added == 1 and [fleet.assignment.count(n) for n in fleet.slots] == [2, 2]
        drafted = {n: r.stats.drafted for n, r in replays.items()}
        time.sleep(1.0)
        assert all(r.stats.drafted > drafted[n] for n, r in replays.items())  # all four speculate
        fleet.set_n_max(4)  # N_max rises (admission "auto"): one draft server carries all four
        _until(loop, fleet, scaler, handles, info,
               lambda: len(fleet.slots) == 1 and all(p.attached for p in proposers.values()))
        assert stopped == ["starjar-draft-1"] and scaler.retired == 1 and fleet.moves["retire"] == 2
        drafted = {n: r.stats.drafted for n, r in replays.items()}
        time.sleep(1.0)
        assert all(r.stats.drafted > drafted[n] for n, r in replays.items())
    finally:
        done.set()
        [t.join(30) for t in threads]
        for p in proposers.values():
            p.close()
        for h in list(fleet.handles.values()):
            h.proc.kill()
        loop.close()
    assert all(r.stats.tokens > 0 for r in replays.values())
