"""The failover run that the draft-fleet chaos tests share: 4 targets x 50 requests in 8 lanes on a running
`starjar up --draft-servers 2` cluster, one of the two draft servers SIGKILLed while they flow, and what
came of it (lost, altered against the target alone, how fast its targets moved to the survivor)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starjar import Client

MAX_TOKENS = 24
TARGETS, PER_TARGET = 4, 50
DRAFTS = ("starjar-draft", "starjar-draft-1")
LANES = 8


def status(controller) -> dict:
    import ray

    return ray.get(controller.status.remote(), timeout=30)


def drafted(name: str) -> int:
    import ray

    return ray.get(ray.get_actor(name, namespace="starjar").stats.remote(), timeout=30)["drafted_tokens"]


def wait_moved(controller, moved: list[str], survivor: str, t_kill: float) -> dict[str, float]:
    """Seconds from the kill to each moved target's attach on the survivor (its draft client's clock)."""
    deadline, took = time.time() + 60, {}
    while time.time() < deadline and len(took) < len(moved):
        st = status(controller)
        there = st["actors"][survivor]["address"]
        for t in moved:
            a = st["actors"][t]
            if a.get("draft_address") == there and (a.get("draft_attached_at") or 0) > t_kill:
                took[t] = a["draft_attached_at"] - t_kill
        time.sleep(0.05)
    assert len(took) == len(moved), f"not moved: {status(controller)['drafts']}"
    return took


def workload(prompt_ids: list, reference, n: int) -> tuple[list, list]:
    """n prompts (the Spec-Bench set repeated) and what the target alone makes of each, MAX_TOKENS long."""
    prompts = (prompt_ids * (n // len(prompt_ids) + 1))[:n]
    ref = [r[:MAX_TOKENS] for r in reference("llama", 64)]
    return prompts, (ref * (n // len(ref) + 1))[:n]


def lane_of(address: str, prompts: list, results: list, errors: list) -> Callable[[list[int]], None]:
    """One client lane: generates the given prompt indices in turn into results; a failure goes to errors."""
    def lane(idx: list[int]) -> None:
        try:
            with Client(address, timeout=600) as c:
                for i in idx:
                    results[i] = c.generate(prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS).token_ids
        except Exception as exc:  # noqa: BLE001 - any failure is the test's failure
            errors.append(exc)

    return lane


@dataclass
class FailoverRun:
    requests: int
    lost: int
    altered: int
    errors: list[Exception]
    moved: list[str]
    took: dict[str, float]  # target -> seconds from the kill to its attach on the survivor
    speculating_after: bool  # every moved target drafted more tokens in the second after its move
    while_running: object  # what the caller's hook returned before the lanes were joined


def kill_one_draft_under_load(addrs: dict, controller, prompt_ids: list, reference,
                              while_running: Callable[[int], object] | None = None) -> FailoverRun:
    """SIGKILL the second draft server 3 s into the load (same machine: its pid is ours to signal); the hook,
    given the killed pid, runs after the move and before the lanes are joined."""
    st = status(controller)
    n = TARGETS * PER_TARGET
    prompts, ref = workload(prompt_ids, reference, n)
    results, errors = [None] * n, []
    lane = lane_of(addrs["grpc"], prompts, results, errors)
    with ThreadPoolExecutor(LANES) as pool:
        futs = [pool.submit(lane, list(range(k, n, LANES))) for k in range(LANES)]
        # Kill a quarter of the way through: requests in flight on both draft servers and most still to come
        # (a fixed 3 s was the whole workload on a fast machine, and nothing was left to draft after the move).
        deadline = time.time() + 120
        while sum(r is not None for r in results) < n // 4 and time.time() < deadline:
            time.sleep(0.05)
        moved = st["drafts"]["servers"][DRAFTS[1]]["attached"]
        old_pid = st["actors"][DRAFTS[1]]["pid"]
        t_kill = time.time()
        os.kill(old_pid, signal.SIGKILL)
        took = wait_moved(controller, moved, DRAFTS[0], t_kill)
        before = {t: drafted(t) for t in moved}
        time.sleep(1.0)
        after = {t: drafted(t) for t in moved}
        hooked = while_running(old_pid) if while_running else None
        [f.result() for f in futs]
    lost = sum(r is None for r in results)
    altered = sum(r is not None and r != e for r, e in zip(results, ref, strict=True))
    return FailoverRun(n, lost, altered, errors, moved, took, all(after[t] > before[t] for t in moved), hooked)
