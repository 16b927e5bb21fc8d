"""What the star simulator is calibrated with: costs measured on this machine, and the replay's workload.

Both come from the real draft engine (draft_server/engine.py) in this process, with as many torch threads
as each draft server of the replay bench gets (one), and from nothing the validation measures:
- cost by batch: seconds of one `advance()` (one forward pass and its per-row bookkeeping) over b short
  rows, b = 1 .. 16; the seconds of `start()` per round (the loop's bookkeeping); the seconds of a new
  sequence's prompt pass as a linear function of its tokens;
- the workload: each script (prompt, the target's greedy continuation) decoded by a replay target against
  the engine, round by round: the passes each round asks for (gamma, fewer at the end), the tokens it
  gains and the prompt fed on first sight. Greedy drafts do not depend on timing, so these are the rounds
  the replay bench's targets send.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

from benchmarks.fabric_sim import SHORT_FEED, PassCost, Round
from draft_server.engine import DraftEngine
from starjar.proposer import DraftRequest
from target_worker.replay import ReplayTarget

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
ROUNDS_PER_SIZE = 4  # rounds of gamma passes timed per batch size (the median pass is kept)


@contextmanager
def torch_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Recorder:
    """A Proposer over the engine that notes each request's shape and the time of each prompt pass."""

    def __init__(self, engine: DraftEngine):
        self.engine = engine
        self.requests: list[DraftRequest] = []
        self.prompt_passes: list[tuple[int, float]] = []  # (prompt tokens, seconds of its pass)

    def propose(self, requests):
        catchup0 = self.engine.stats.catchup_s
        out = self.engine.propose(requests)
        for r in requests:
            self.requests.append(r)
            if r.start == 0 and r.gamma > 0:
                self.prompt_passes.append((len(r.tokens), self.engine.stats.catchup_s - catchup0))
        return out

    def release(self, seq_ids) -> None:
        self.engine.release(seq_ids)


def workload(engine: DraftEngine, scripts, gamma: int) -> tuple[list[list[Round]], list[tuple[int, float]]]:
    """Each script's rounds as a replay target sends them, and the measured prompt passes."""
    out, prompt_passes = [], []
    for prompt, continuation in scripts:
        rec = _Recorder(engine)
        target = ReplayTarget(rec, gamma, 0.0)
        target.run([(prompt, continuation)])
        reqs = rec.requests
        # A round's new tokens are what the next request tells the draft (every token since the last sync).
        gained = [len(nxt.tokens) for nxt in reqs[1:]]
        gained.append(target.stats.tokens - sum(gained))
        out.append([Round(r.gamma, g, len(r.tokens) if r.start == 0 and len(r.tokens) > SHORT_FEED else 0)
                    for r, g in zip(reqs, gained, strict=True)])
        prompt_passes += rec.prompt_passes
    return out, prompt_passes


def step_cost(engine: DraftEngine, scripts, b: int, gamma: int) -> tuple[float, float]:
    """(median seconds of one pass over b rows, median seconds of start() per round) for b sequences that
    are mid-way through their scripts: each round feeds a short catch-up, then one-token steps."""
    keys = [("cost", b, k) for k in range(b)]
    mine = [scripts[k % len(scripts)] for k in range(b)]
    engine.propose([DraftRequest(key, 0, list(p), gamma) for key, (p, _) in zip(keys, mine, strict=True)])
    passes, starts = [], []
    for r in range(ROUNDS_PER_SIZE):
        reqs = [DraftRequest(key, len(p) + 3 * r, list(c[3 * r: 3 * r + 3]), gamma)
                for key, (p, c) in zip(keys, mine, strict=True)]
        t0 = time.perf_counter()
        _, jobs = engine.start(reqs)
        starts.append((time.perf_counter() - t0) / b)
        live = [j for _, j in jobs]
        while live:
            t0 = time.perf_counter()
            engine.advance(live)
            passes.append(time.perf_counter() - t0)
            live = [j for j in live if not j.done]
    engine.release(keys)
    return statistics.median(passes), statistics.median(starts)


def linear(points: list[tuple[int, float]]) -> PassCost:
    """A least-squares line through (size, seconds), as a PassCost between the smallest and largest size."""
    if not points:
        raise ValueError("no measured points to fit (no prompt longer than a short feed in the workload?)")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(set(xs)) < 2:
        return PassCost([(float(xs[0]), ys[0])])
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return PassCost([(float(x), max(1e-6, my + slope * (x - mx))) for x in (min(xs), max(xs))])


def measure(draft_dir: str, scripts, gamma: int, threads: int = 1) -> dict:
    """The simulator's calibration: costs by batch size, per-round bookkeeping, prompt passes, workload."""
    from starjar.models import load_model

    with torch_threads(threads):
        engine = DraftEngine(load_model(draft_dir))
        engine.propose([DraftRequest("warm-up", 0, list(scripts[0][0]), gamma)])  # first-call costs
        engine.release(["warm-up"])
        rounds, prompt_passes = workload(engine, scripts, gamma)
        by_size = {b: step_cost(engine, scripts, b, gamma) for b in SIZES}
    # Points at neighbouring sizes differ by less than the noise of a shared machine: the simulator takes the
    # least-squares line through them (a pass's cost grows about linearly with its rows at these sizes).
    return {"threads": threads, "step": linear([(b, c[0]) for b, c in by_size.items()]).points,
            "step_measured": [(float(b), c[0]) for b, c in by_size.items()],
            "round_s": statistics.median(c[1] for c in by_size.values()),
            "prefill": linear(prompt_passes).points, "prompt_passes": prompt_passes,
            "scripts": [[vars(r) for r in s] for s in rounds]}


def from_json(d: dict) -> tuple[PassCost, PassCost, float, list[list[Round]]]:
    """(step cost, prefill cost, round_s, scripts) from what measure() returned (or its JSON)."""
    return (PassCost([tuple(p) for p in d["step"]]), PassCost([tuple(p) for p in d["prefill"]]), d["round_s"],
            [[Round(**r) for r in s] for s in d["scripts"]])
