"""`starjar demo`: a local cluster (`starjar up`), a short workload of starjar's own prompts with Poisson arrivals
through the SDK, run with speculation off and then on, a summary table and a plot.

Both runs are greedy on the same prompts and arrival times, so their outputs
must be identical; the demo says so, and fails if they are not.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

from tqdm import tqdm

from draft_server.lookahead import MODES as LOOKAHEAD_MODES
from starjar import workloads


def add_demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="local cluster, starjar's own prompts with Poisson arrivals, speculation off vs on")
    d.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    d.add_argument("--prompts", default=None, metavar="FILE",
                   help="JSON lines of prompts instead of starjar's own (each with 'prompt', or 'turns' as in "
                        "Spec-Bench's question.jsonl), taken round-robin over their categories")
    d.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (default 1)")
    d.add_argument("--max-tokens", type=int, default=48, help="new tokens per request (default 48)")
    d.add_argument("--targets", type=int, default=1, help="target workers, if the demo starts the cluster")
    d.add_argument("--gamma", type=int, default=None, help="draft tokens per step when speculating, forced (default: "
                   "adaptive, the Nightjar planner up to the gamma `starjar models build` measured best on this "
                   "machine; where speculation does not pay here, the demo says so and lets the planner decide)")
    d.add_argument("--batch-size", type=int, default=1, help="running requests per target (default 1)")
    d.add_argument("--threads", type=int, default=2, help="torch threads of the target worker (default 2: draft "
                   "and target take turns, so it can use both cores of a small machine)")
    d.add_argument("--draft-threads", type=int, default=2, help="torch threads of the draft server (default 2: "
                   "at batch 1 the one target waits while its draft runs; a short OpenMP spin "
                   "(controller.cluster.omp_env) keeps a waiting process's threads off the cores)")
    d.add_argument("--lookahead", choices=LOOKAHEAD_MODES, default="off",
                   help="the draft server's lookahead, if the demo starts the cluster (default off; see `starjar up "
                        "--lookahead`)")
    d.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    d.add_argument("--plot", default="starjar-demo.png", help="where to save the plot")
    d.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


async def _workload(address: str, prompts: list[str], arrivals: list[float], max_tokens: int, label: str) -> dict:
    from starjar import AsyncClient

    bar = tqdm(total=len(prompts), desc=label, unit="req", file=sys.stderr)
    events: list[tuple[float, int]] = []  # (seconds since start, tokens) as chunks arrive
    async with AsyncClient(address, timeout=900) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> dict:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            sent, first, ids, usage = time.perf_counter(), None, [], None
            async for chunk in client.generate_stream(prompts[i], chat=True, max_tokens=max_tokens):
                now = time.perf_counter()
                if chunk.token_ids:
                    first = first or now
                    ids += chunk.token_ids
                    events.append((now - t0, len(chunk.token_ids)))
                usage = chunk.usage or usage
            end = time.perf_counter()
            bar.update(1)
            return {"ids": ids, "ttft": first - sent, "tpot": (end - first) / (len(ids) - 1) if len(ids) > 1 else None,
                    "drafted": usage.draft_tokens, "accepted": usage.accepted_draft_tokens}

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    bar.close()
    tokens = sum(len(r["ids"]) for r in results)
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    drafted = sum(r["drafted"] for r in results)
    return {"label": label, "results": results, "events": sorted(events), "wall": wall, "tokens": tokens,
            "tok_s": tokens / wall, "ttft": [r["ttft"] for r in results], "tpot": tpot,
            "accept": sum(r["accepted"] for r in results) / drafted if drafted else None}


def _row(run: dict) -> str:
    ttft, tpot = run["ttft"], run["tpot"]
    accept = f"{run['accept']:.2f}" if run["accept"] is not None else "-"
    return (f"{run['label']:<22}{len(run['results']):>5}{run['tokens']:>7}{run['tok_s']:>8.1f}"
            f"{_pct(ttft, .5):>9.2f}s{_pct(ttft, .99):>8.2f}s{_pct(tpot, .5) * 1000:>8.0f}ms"
            f"{_pct(tpot, .99) * 1000:>7.0f}ms{accept:>8}")


def _plot(runs: list[dict], path: str) -> bool:
    """Throughput over time and the TPOT CDF of each run, saved to `path`; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        times = [t for t, _ in run["events"]]
        total, cum = 0, []
        for _, n in run["events"]:
            total += n
            cum.append(total)
        left.plot(times, cum, label=f"{run['label']} ({run['tok_s']:.1f} tok/s)")
        tp = sorted(x * 1000 for x in run["tpot"])
        right.plot(tp, [(i + 1) / len(tp) for i in range(len(tp))], label=run["label"])
    left.set(xlabel="seconds since the first arrival", ylabel="output tokens delivered", title="Throughput")
    right.set(xlabel="time per output token (ms)", ylabel="fraction of requests", title="TPOT per request (CDF)")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _cluster(args) -> tuple[dict, bool, str | None]:
    """The running local cluster, or one started now: (its state, whether the demo started it, the measured
    verdict when speculation does not pay here)."""
    from controller.cluster.local import adaptive_defaults, local_spec, read_state, start_local

    state = read_state()
    if state is not None:
        print(f"using the running cluster at {state['addresses']['grpc']}", file=sys.stderr)
        return state, False, None
    chosen = adaptive_defaults(None, None, False, args.gamma, None)
    # Measured not to pay here: the second run is what serving would do, off.
    verdict = None if chosen.speculates else chosen.note
    spec = local_spec(targets=args.targets, gamma=chosen.gamma, policy=chosen.policy, batch_size=args.batch_size,
                      threads=args.threads, draft_threads=args.draft_threads, grpc_port=0, http_port=0,
                      draft_server={"lookahead": args.lookahead} if args.lookahead != "off" else {})
    print("starting a local cluster (starjar up) ...", file=sys.stderr)
    start_local(spec)
    return read_state(), True, verdict


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


def _both_runs(args, controller, address: str, spec: dict, prompts: list[str]) -> tuple[dict, dict]:
    """Speculation off, then on (as configured), on the same prompts and arrival times."""
    import ray

    adaptive = spec["policy"] != "fixed"
    label = (f"spec on, {spec['policy']}<={spec['gamma']}" if adaptive
             else f"speculation on, gamma={spec['gamma']}" if spec["gamma"] else "as measured: off")
    arrivals = _arrivals(len(prompts), args.rate, args.seed)
    asyncio.run(_workload(address, prompts[:2], [0.0, 0.0], 4, "warm-up"))
    ray.get(controller.set_gamma.remote(0))
    off = asyncio.run(_workload(address, prompts, arrivals, args.max_tokens, "speculation off"))
    ray.get(controller.set_gamma.remote(None if adaptive else spec["gamma"]))
    on = asyncio.run(_workload(address, prompts, arrivals, args.max_tokens, label))
    ray.get(controller.set_gamma.remote(None))
    return off, on


def _summary(args, spec: dict, off: dict, on: dict, verdict: str | None) -> int:
    """Print the table; how many outputs the two runs share (all of them: greedy is lossless)."""
    from starjar.cpu.kernels import machine_label

    n = len(off["results"])
    same = sum(a["ids"] == b["ids"] for a, b in zip(off["results"], on["results"], strict=True))
    source = args.prompts or "starjar's own"
    print(f"\nstarjar demo: {n} prompts ({source}, chat), Poisson arrivals at {args.rate:g}/s, "
          f"greedy, max {args.max_tokens} new tokens")
    print(f"cluster: {spec['targets']} target worker(s) (batch {spec['batch_size']}), draft server "
          f"{'on' if spec['draft'] else 'off'}; target {spec['target']}")
    print(f"machine: {machine_label()}\n")
    print(f"{'run':<22}{'reqs':>5}{'tokens':>7}{'tok/s':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>9}"
          f"{'accept':>8}")
    print(_row(off))
    print(_row(on))
    if verdict:
        print(f"\nnote: {verdict}; the second run serves as starjar would here, without speculation "
              "(--gamma N forces it)")
    print(f"\nspeedup {on['tok_s'] / off['tok_s']:.2f}x output tokens/s, TPOT p50 "
          f"{_pct(off['tpot'], .5) / _pct(on['tpot'], .5):.2f}x; identical outputs {same}/{n} "
          "(lossless)")
    return same


def run_demo(args) -> int:
    from controller.cluster.spec import CONTROLLER, NAMESPACE, local_ray_env

    local_ray_env()  # before Ray is imported: it reads these at import time
    import ray

    from controller.cluster.local import stop_local

    if args.requests < 1 or args.rate <= 0 or args.max_tokens < 1:
        from starjar.errors import InvalidArgument
        raise InvalidArgument("--requests/--rate/--max-tokens", "must be positive")
    state, started, verdict = _cluster(args)
    try:
        ray.init(address=state["ray_address"], namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        spec = ray.get(controller.describe.remote())
        address = state["addresses"]["grpc"]
        prompts = workloads.texts(workloads.mix(
            workloads.spec_bench_prompts(args.prompts) if args.prompts else workloads.own_prompts(), args.requests))
        off, on = _both_runs(args, controller, address, spec, prompts)
    finally:
        ray.shutdown()
        if started and not args.keep:
            stop_local()
    same = _summary(args, spec, off, on, verdict)
    _report_plot(off, on, args.plot)
    if args.keep and started:
        print(f"the cluster is still up at {address} (starjar down stops it)")
    return 0 if same == len(prompts) else 1


def _report_plot(off: dict, on: dict, path: str) -> None:
    if _plot([off, on], path):
        print(f"plot: {path}")
    else:  # matplotlib is the bench extra's, not a dependency of serving
        print("plot: not drawn, it needs matplotlib: pip install 'starjar[bench]'")
