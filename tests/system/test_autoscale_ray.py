"""Autoscaling end to end on Ray: `starjar up --autoscale-drafts 1..2` (the code `starjar up` runs,
real Ray actors, real gRPC, tiny models). Load from 8 clients saturates the one draft server, the controller
adds a second and its targets speculate there; with the load down to one slow client the second is drained
and retired. Every output equals the target alone and none is lost, before, during and after both steps.

The saturation guard is off here (`--no-saturation-guard`): whether it would turn speculation off for the
saturated server first depends on this machine's speeds; the autoscaler's own decisions are what is tested."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fleet_load import MAX_TOKENS, drafted, status
from local_cluster import up_cluster

from starjar import Client

pytestmark = pytest.mark.slow
TARGETS, LANES = 4, 8
SECOND = "starjar-draft-1"


@pytest.fixture(scope="module")
def scaled(model_dirs, tmp_path_factory):
    with up_cluster(tmp_path_factory, "--target", model_dirs["llama"], "--draft", model_dirs["draft"],
                    "--targets", str(TARGETS), "--autoscale-drafts", "1..2",
                    "--max-targets", str(TARGETS), "--gamma", "8", "--draft-mode", "fifo", "--batch-size", "4",
                    "--no-saturation-guard") as running:
        yield running


def _wait(controller, cond, what: str, timeout: float = 150.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = status(controller)
        if cond(st):
            return st
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s: {status(controller)}")


class _Load:
    """Clients sending the prompts one after another (each lane after `pause_s`), checking nothing."""

    def __init__(self, address: str, prompts: list, lanes: int, pause_s: float = 0.0):
        self.address, self.prompts, self.pause_s = address, prompts, pause_s
        self.stop = threading.Event()
        self.results: list[tuple[int, list[int] | None]] = []
        self.errors: list[Exception] = []
        self.pool = ThreadPoolExecutor(lanes)
        self.futs = [self.pool.submit(self._lane, k) for k in range(lanes)]

    def _lane(self, k: int) -> None:
        try:
            with Client(self.address, timeout=600) as c:
                while not self.stop.is_set():
                    i = k % len(self.prompts)
                    out = c.generate(prompt_token_ids=self.prompts[i], max_tokens=MAX_TOKENS).token_ids
                    self.results.append((i, out))
                    k += 7
                    self.stop.wait(self.pause_s)
        except Exception as exc:  # noqa: BLE001 - any failure is the test's failure
            self.errors.append(exc)

    def end(self) -> None:
        self.stop.set()
        [f.result() for f in self.futs]
        self.pool.shutdown()


def test_autoscale_adds_a_draft_server_under_load_and_retires_it_when_idle(scaled, prompt_ids, reference):
    addrs, controller = scaled
    ref = [r[:MAX_TOKENS] for r in reference("llama", 64)]
    st = status(controller)
    assert list(st["drafts"]["servers"]) == ["starjar-draft"] and st["autoscale"]["added"] == 0
    heavy = _Load(addrs["grpc"], prompt_ids, LANES)
    try:
        st = _wait(controller, lambda s: s["autoscale"]["added"] == 1 and SECOND in s["actors"]
                   and len(s["drafts"]["servers"][SECOND]["attached"]) == 2, "a second draft server")
        moved = st["drafts"]["servers"][SECOND]["attached"]
        there = _wait(controller, lambda s: all(s["actors"][t].get("draft_address") == s["actors"][SECOND]["address"]
                                                and s["actors"][t].get("draft_attached") for t in moved),
                      "its targets attached to it")
        loads_at_add = {d: v["load"] for d, v in st["drafts"]["servers"].items()}
        before = {t: drafted(t) for t in moved}
        time.sleep(2.0)
        assert all(drafted(t) > before[t] for t in moved)  # speculating on the new server
    finally:
        heavy.end()
    light = _Load(addrs["grpc"], prompt_ids, 1, pause_s=0.5)  # a trickle: the retire happens under traffic
    try:
        done = _wait(controller, lambda s: s["autoscale"]["retired"] == 1 and len(s["drafts"]["servers"]) == 1
                     and all(a.get("draft_attached") for n, a in s["actors"].items() if n.startswith("starjar-target")),
                     "the second draft server retired")
        time.sleep(2.0)
    finally:
        light.end()
    results = heavy.results + light.results
    lost = len(heavy.errors) + len(light.errors)
    altered = sum(out != ref[i] for i, out in results)
    print(f"autoscale 1..2: added at loads {loads_at_add}, {SECOND} served {sorted(moved)}; "
          f"retired -> {list(done['drafts']['servers'])}, moves {done['drafts']['moves']}; "
          f"{len(results)} requests ({len(heavy.results)} heavy, {len(light.results)} light), "
          f"lost {lost}, altered {altered}; attached then {there['drafts']['assignment']}")
    assert lost == 0 and altered == 0 and light.results, (heavy.errors, light.errors)
    assert done["drafts"]["moves"].get("retire", 0) >= 1
    (left,) = done["drafts"]["servers"].values()
    assert len(left["attached"]) == TARGETS and not done["drafts"]["without_draft"]  # one carries all four
