"""How much draft servers sharing one host slow each other: the simulator's host model (fabric_sim.Hosts).

k draft engines (draft_server/engine.py), each in a process of its own with one torch thread, as each draft
server of the replay bench has, draft rounds of one row back to back at the same time on this machine; the
mean seconds of a drafting pass with k at once over that with one alone is the slowdown of k busy servers.
Nothing here runs a draft server or a replay target: the figure does not come from what it is checked against.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time


def _drafting(draft_dir: str, scripts, gamma: int, seconds: float, go, out) -> None:
    """One engine in this process: a warm-up, then (once every process is ready) rounds of one row with no
    verification time in between for `seconds`; puts the mean seconds of a step pass (catch-up of a usual
    round and one-token steps; the prompts' passes are left out)."""
    import torch

    from draft_server.engine import DraftEngine
    from starjar.models import load_model
    from target_worker.replay import ReplayTarget

    torch.set_num_threads(1)
    engine = DraftEngine(load_model(draft_dir))
    ReplayTarget(engine, gamma, 0.0).run(scripts[:1])  # first-call costs
    go.wait()
    s0, n0 = engine.stats.step_s, engine.stats.steps
    ReplayTarget(engine, gamma, 0.0).run_in_turn(scripts, seconds)
    out.put((engine.stats.step_s - s0) / max(1, engine.stats.steps - n0))


def pass_seconds(draft_dir: str, scripts, gamma: int, k: int, seconds: float) -> list[float]:
    """Each of k engines' mean pass seconds while all k draft at once."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_drafting, args=(draft_dir, scripts, gamma, seconds, go, out), daemon=True)
             for _ in range(k)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + seconds + 300
    try:
        while len(got) < k:
            try:
                got.append(out.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    raise RuntimeError("a drafting process died or hung before it reported") from None
        return got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def contention(draft_dir: str, scripts, gamma: int, servers: int = 2, seconds: float = 6.0) -> dict:
    """The slowdown of 1 .. `servers` engines busy at once on this host, each against one engine alone
    (measured alone before and after the others, and the mean taken: the machine's background drifts)."""
    alone = pass_seconds(draft_dir, scripts, gamma, 1, seconds)
    together = {k: pass_seconds(draft_dir, scripts, gamma, k, seconds) for k in range(2, servers + 1)}
    alone += pass_seconds(draft_dir, scripts, gamma, 1, seconds)
    base = statistics.fmean(alone)
    slowdown = [1.0] + [round(statistics.fmean(together[k]) / base, 4) for k in range(2, servers + 1)]
    return {"pass_s_alone": alone, "pass_s_together": {str(k): v for k, v in together.items()},
            "slowdown": slowdown, "seconds": seconds, "threads": 1}
