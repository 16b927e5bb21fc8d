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

from benchmarks.fabric_batched import batched_workloads
from benchmarks.sims.fabric_sim import PassCost, Round, as_round
from draft_server.engine import DraftEngine
from starjar.spec.proposer import DraftRequest
from target_worker.replay import ReplayTarget

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
CATCHUP_WIDTH = 3  # tokens each row's first pass of a timed round feeds
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
        out.append([as_round(r, g) for r, g in zip(reqs, gained, strict=True)])
        prompt_passes += rec.prompt_passes
    return out, prompt_passes


def step_cost(engine: DraftEngine, scripts, b: int, gamma: int) -> tuple[float, float, float, float]:
    """(median seconds of a one-token pass over b rows, median seconds of start() per round, median seconds
    of a catch-up pass over b rows, the median width that catch-up fed: at most CATCHUP_WIDTH, fewer where the
    draft's KV already holds its drafts of them) for b sequences mid-way through their
    scripts: each round feeds a short catch-up, then one-token steps."""
    keys = [("cost", b, k) for k in range(b)]
    mine = [scripts[k % len(scripts)] for k in range(b)]
    engine.propose([DraftRequest(key, 0, list(p), gamma) for key, (p, _) in zip(keys, mine, strict=True)])
    passes, starts, catchups, widths = [], [], [], []
    w = CATCHUP_WIDTH
    for r in range(ROUNDS_PER_SIZE):
        reqs = [DraftRequest(key, len(p) + w * r, list(c[w * r: w * r + w]), gamma)
                for key, (p, c) in zip(keys, mine, strict=True)]
        t0 = time.perf_counter()
        _, jobs = engine.start(reqs)
        starts.append((time.perf_counter() - t0) / b)
        live = [j for _, j in jobs]
        while live:
            t0 = time.perf_counter()
            first = all(j.passes == 0 for j in live)
            if first:  # what the catch-up really feeds: the tokens the draft's KV lacks, at most w
                widths.append(max(len(j.feed) for j in live))
            engine.advance(live)
            (catchups if first else passes).append(time.perf_counter() - t0)
            live = [j for j in live if not j.done]
    engine.release(keys)
    return statistics.median(passes), statistics.median(starts), statistics.median(catchups), \
        statistics.median(widths)


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


def measure(draft_dir: str, scripts, gamma: int, z_s: float, fingerprint: str, threads: int = 1,
            servers: int = 2) -> dict:
    """The simulator's calibration: costs by batch size and width, per-round bookkeeping, prompt passes, the
    single-row and batched workloads, and the slowdown of 1 .. `servers` draft servers busy at once on this host."""
    from benchmarks.fabric_contention import contention
    from starjar.model.loading import load_model

    with torch_threads(threads):
        engine = DraftEngine(load_model(draft_dir))
        engine.propose([DraftRequest("warm-up", 0, list(scripts[0][0]), gamma)])  # first-call costs
        engine.release(["warm-up"])
        rounds, prompt_passes = workload(engine, scripts, gamma)
        by_size = {b: step_cost(engine, scripts, b, gamma) for b in SIZES}
        # A one-row pass takes torch's fused int8 kernel, several rows the per-row scaled path
        # (starjar/cpu/quantized.py): step(1) is its own point. Points at neighbouring sizes past it differ by less
        # than the noise of a shared machine: the least-squares line through them (about linear at these sizes).
        step = [(1.0, by_size[1][0])] + linear([(b, c[0]) for b, c in by_size.items() if b > 1]).points
        batched = batched_workloads(engine, scripts, gamma, rounds, PassCost(step), z_s)
    return {"threads": threads, "step": step, "step_measured": [(float(b), c[0]) for b, c in by_size.items()],
            "catchup": linear([(b, c[2]) for b, c in by_size.items()]).points,
            "catchup_width": statistics.median(c[3] for c in by_size.values()),
            "catchup_measured": [(float(b), c[2]) for b, c in by_size.items()],
            "round_s": statistics.median(c[1] for c in by_size.values()),
            "prefill": linear(prompt_passes).points, "prompt_passes": prompt_passes,
            "scripts": _plain(rounds), "batched_scripts": {str(n): _plain(w) for n, w in batched.items()},
            "contention": contention(draft_dir, scripts, fingerprint, servers)}


def _plain(rounds: list[list[Round]]) -> list[list[dict]]:
    return [[vars(r) for r in s] for s in rounds]


def _rounds(scripts: list[list[dict]]) -> list[list[Round]]:
    return [[Round(**r) for r in s] for s in scripts]


def from_json(d: dict) -> dict:
    """What measure() returned (or its JSON) as the simulator's types: step, catchup and prefill costs
    (PassCost), round_s, catchup_width, scripts, batched_scripts {targets per server: scripts}, slowdown."""
    points = {k: PassCost([tuple(p) for p in d[k]]) if d.get(k) else None for k in ("step", "catchup", "prefill")}
    scripts = _rounds(d["scripts"])
    batched = {int(n): _rounds(w) for n, w in d.get("batched_scripts", {}).items()} or {1: scripts}
    return {**points, "round_s": d["round_s"], "catchup_width": d.get("catchup_width", CATCHUP_WIDTH),
            "scripts": scripts, "batched_scripts": batched,
            "slowdown": tuple(d.get("contention", {}).get("slowdown", (1.0,)))}
