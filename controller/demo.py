"""`starjar demo`: a local cluster (`starjar up`), a short Spec-Bench workload with Poisson arrivals
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

from starjar.workloads import spec_bench_mix


def add_demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="local cluster, Spec-Bench with Poisson arrivals, speculation off vs on")
    d.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    d.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (default 1)")
    d.add_argument("--max-tokens", type=int, default=48, help="new tokens per request (default 48)")
    d.add_argument("--targets", type=int, default=1, help="target workers, if the demo starts the cluster")
    d.add_argument("--gamma", type=int, default=None, help="draft tokens per step when speculating, forced (default: "
                   "adaptive, the Nightjar planner up to the gamma `starjar models build` measured best on this "
                   "machine; where speculation does not pay here, the demo says so and lets the planner decide)")
    d.add_argument("--batch-size", type=int, default=1, help="running requests per target (default 1)")
    d.add_argument("--threads", type=int, default=2, help="torch threads of the target worker (default 2: draft "
                   "and target take turns, so it can use both cores of a small machine)")
    d.add_argument("--draft-threads", type=int, default=1, help="torch threads of the draft server (default 1)")
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


def _plot(runs: list[dict], path: str) -> None:
    import matplotlib

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


def run_demo(args) -> int:
    from controller.cluster_spec import CONTROLLER, NAMESPACE, local_ray_env

    local_ray_env()  # before Ray is imported: it reads these at import time
    import ray

    from controller.local_cluster import adaptive_defaults, local_spec, read_state, start_local, stop_local

    if args.requests < 1 or args.rate <= 0 or args.max_tokens < 1:
        from starjar.errors import InvalidArgument
        raise InvalidArgument("--requests/--rate/--max-tokens", "must be positive")
    state, started, verdict = read_state(), False, None
    if state is None:
        chosen = adaptive_defaults(None, None, False, args.gamma, None)
        if not chosen.speculates:  # measured not to pay here: the second run is what serving would do, off
            verdict = chosen.note
        spec = local_spec(targets=args.targets, gamma=chosen.gamma, policy=chosen.policy, batch_size=args.batch_size,
                          threads=args.threads, draft_threads=args.draft_threads, grpc_port=0, http_port=0)
        print("starting a local cluster (starjar up) ...", file=sys.stderr)
        start_local(spec)
        state, started = read_state(), True
    else:
        print(f"using the running cluster at {state['addresses']['grpc']}", file=sys.stderr)
    try:
        ray.init(address=state["ray_address"], namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        spec = ray.get(controller.describe.remote())
        adaptive = spec["policy"] != "fixed"
        label = (f"spec on, {spec['policy']}<={spec['gamma']}" if adaptive
                 else f"speculation on, gamma={spec['gamma']}" if spec["gamma"] else "as measured: off")
        address = state["addresses"]["grpc"]
        prompts = spec_bench_mix(args.requests)
        rng = random.Random(args.seed)
        arrivals, t = [], 0.0
        for _ in prompts:
            arrivals.append(t)
            t += rng.expovariate(args.rate)
        asyncio.run(_workload(address, prompts[:2], [0.0, 0.0], 4, "warm-up"))
        ray.get(controller.set_gamma.remote(0))
        off = asyncio.run(_workload(address, prompts, arrivals, args.max_tokens, "speculation off"))
        ray.get(controller.set_gamma.remote(None if adaptive else spec["gamma"]))
        on = asyncio.run(_workload(address, prompts, arrivals, args.max_tokens, label))
        ray.get(controller.set_gamma.remote(None))
    finally:
        ray.shutdown()
        if started and not args.keep:
            stop_local()
    same = sum(a["ids"] == b["ids"] for a, b in zip(off["results"], on["results"], strict=True))
    print(f"\nstarjar demo: {len(prompts)} Spec-Bench prompts (chat), Poisson arrivals at {args.rate:g}/s, "
          f"greedy, max {args.max_tokens} new tokens")
    print(f"cluster: {spec['targets']} target worker(s) (batch {spec['batch_size']}), draft server "
          f"{'on' if spec['draft'] else 'off'}; target {spec['target']}")
    from starjar.kernels import machine_label

    print(f"machine: {machine_label()}\n")
    print(f"{'run':<22}{'reqs':>5}{'tokens':>7}{'tok/s':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>9}"
          f"{'accept':>8}")
    print(_row(off))
    print(_row(on))
    if verdict:
        print(f"\nnote: {verdict}; the second run serves as starjar would here, without speculation "
              "(--gamma N forces it)")
    print(f"\nspeedup {on['tok_s'] / off['tok_s']:.2f}x output tokens/s, TPOT p50 "
          f"{_pct(off['tpot'], .5) / _pct(on['tpot'], .5):.2f}x; identical outputs {same}/{len(prompts)} "
          "(lossless)")
    _plot([off, on], args.plot)
    print(f"plot: {args.plot}")
    if args.keep and started:
        print(f"the cluster is still up at {address} (starjar down stops it)")
    return 0 if same == len(prompts) else 1
