"""`starjar bench breakdown`: where the speedup goes between co-located and `starjar up`.

The demo's prompts (starjar's own unless --dataset, chat template, 48 new tokens), one request at
a time, greedy, without speculation and at one fixed gamma, in three
deployments on this machine:
- co-located: the draft engine in the target's process (one thread);
- processes: `starjar serve draft` and `starjar serve target` on loopback;
- ray: `starjar up` (Ray actors for the draft server and one target worker,
  the front end relaying every token);
- beside-ray: a `serve target` process without drafts while that cluster
  idles beside it, and the cluster's CPU share and wake-ups at rest
  (benchmarks/background.py): the cost of the cluster's presence alone.
Each gets the same threads per process (--threads, default 2). For each run:
the wall time, the target engine's time by phase (prefill, propose, verify:
`starjar_target_engine_seconds`) per decode step, and for remote drafts the
rounds' wire, queue and compute as the target measured them. Outputs are
compared token for token with the co-located run without speculation.
"""

from __future__ import annotations

import os
import sys
import time

from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from benchmarks.common import pair_dirs, prompt_texts
from starjar.spec.sampling import SamplingParams
from target_worker.metrics import ENGINE_PHASES as PHASES

MAX_NEW = 48
BESIDE = "beside-ray"  # a serve target process without drafts, next to the idle Ray cluster


def run(args) -> dict:
    from transformers import AutoTokenizer

    from starjar.model.text import encode_prompt

    target_dir, draft_dir, note = pair_dirs(args)
    n = args.requests or (8 if args.quick else 16)
    threads = args.threads or 2
    import torch

    torch.set_num_threads(threads)  # the measurement this looks up is per thread count
    gamma = args.gamma if args.gamma is not None else _measured_gamma(target_dir, draft_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)  # the model itself loads in the co-located part only
    prompts = [encode_prompt(tok, p.text, chat=True) for p in prompt_texts(args, n)]
    # Servers first, beside a process that has loaded no model yet. Whether that matters is unsettled: one
    # comparison gave 214 against 180 ms per prompt prefill in `serve target`, a later servers-first run 213.
    runs = _processes(target_dir, draft_dir, prompts, gamma, threads)
    runs += _ray(target_dir, draft_dir, prompts, gamma, threads)
    runs += _colocated(target_dir, draft_dir, prompts, gamma, threads)
    reference = next(r["outputs"] for r in runs if r["deployment"] == "co-located" and r["gamma"] == 0)
    for r in runs:
        r["identical"] = sum(a == b for a, b in zip(r["outputs"], reference, strict=True))
    for r in runs:
        del r["outputs"]
    table = _speedups(runs)
    _print(runs, table)
    return {"pair": {"target": os.path.basename(target_dir), "draft": os.path.basename(draft_dir), "note": note},
            "workload": {"prompts": n, "source": (getattr(args, "dataset", None) or "own") + ", chat",
                         "max_new_tokens": MAX_NEW,
                         "concurrency": 1}, "gamma": gamma, "threads_per_process": threads,
            "runs": runs, "speedup": table}


def _measured_gamma(target_dir: str, draft_dir: str) -> int:
    """The gamma `starjar models build` measured for this pair on this machine and thread count (measured now
    if it has not been, as `starjar up` would); 2 where it found that speculation does not pay."""
    from controller.tuning.pair_check import measured_acceptance

    return measured_acceptance(target_dir, draft_dir).get("gamma") or 2


def _record(deployment: str, gamma: int, wall: float, outputs: list, phases: dict, steps: int,
            rounds: dict | None = None) -> dict:
    tokens = sum(map(len, outputs))
    row = {"deployment": deployment, "gamma": gamma, "wall_s": round(wall, 2), "tokens": tokens,
           "tokens_per_s": round(tokens / wall, 2), "decode_steps": steps,
           "engine_s": {k: round(v, 3) for k, v in phases.items()},
           "ms_per_decode_step": {k: round(1000 * phases[k] / max(steps, 1), 2) for k in ("propose", "verify")},
           "ms_per_prompt_prefill": round(1000 * phases["prefill"] / max(len(outputs), 1), 1),
           "outputs": outputs}
    if rounds:
        row["draft_rounds"] = rounds
    return row


# ---- co-located -------------------------------------------------------------------------------


def _colocated(target_dir: str, draft_dir: str, prompts, gamma: int, threads: int) -> list[dict]:
    from controller.colocated import colocated_engine, load_pair

    target, draft = load_pair(target_dir, draft_dir)
    colocated_engine(target, draft, gamma, 1).generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    rows = []
    for g in (0, gamma):
        eng = colocated_engine(target, draft if g else None, g, 1)
        t0 = time.perf_counter()
        reqs = eng.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
        wall = time.perf_counter() - t0
        s = eng.stats
        rows.append(_record("co-located", g, wall, [r.output_ids for r in reqs],
                            {p: getattr(s, p + "_s") for p in PHASES}, s.decode_steps))
        print(f"co-located gamma {g}: {wall:.1f} s", file=sys.stderr)
    return rows


# ---- separate processes and the Ray cluster: requests through the SDK, phases from /metrics ----------


def _warm_up(address: str, prompt) -> None:
    """The connection and the first passes, outside the measurement."""
    from starjar.client import Client

    with Client(address, timeout=600) as c:
        c.generate(prompt_token_ids=prompt, max_tokens=4)


def _sequential(address: str, prompts, label: str) -> tuple[float, list]:
    from starjar.client import Client

    outs = []
    with Client(address, timeout=600) as c:
        t0 = time.perf_counter()
        for p in tqdm(prompts, desc=label, file=sys.stderr):
            outs.append(c.generate(prompt_token_ids=p, max_tokens=MAX_NEW).token_ids)
        return time.perf_counter() - t0, outs


def _scrape(address: str) -> dict:
    """The target's engine phases, decode steps and draft-round parts (cumulative) from its /metrics."""
    from controller.cluster.local import cluster_token
    from starjar.service.metrics import scrape

    text = scrape(address, cluster_token())
    out = {"phases": dict.fromkeys(PHASES, 0.0), "steps": 0, "rounds": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.name == "starjar_target_engine_seconds" and s.name.endswith("_total"):
                out["phases"][s.labels["phase"]] = s.value
            elif fam.name == "starjar_target_decode_steps" and s.name.endswith("_total"):
                out["steps"] = int(s.value)
            elif fam.name == "starjar_target_draft_round_part_seconds" and s.name.endswith("_sum"):
                out["rounds"][s.labels["part"] + "_s"] = s.value
            elif fam.name == "starjar_target_draft_round_part_seconds" and s.name.endswith("_count"):
                out["rounds"]["rounds"] = int(s.value)
    return out


def measure_deployment(deployment: str, gamma: int, address: str, metrics: str, prompts) -> dict:
    _warm_up(address, prompts[0])
    before = _scrape(metrics)
    wall, outs = _sequential(address, prompts, f"{deployment} gamma {gamma}")
    after = _scrape(metrics)
    phases = {p: after["phases"][p] - before["phases"][p] for p in PHASES}
    rounds = {k: round(v - before["rounds"].get(k, 0), 3) for k, v in after["rounds"].items()}
    if rounds.get("rounds"):
        rounds["wire_ms_per_round"] = round(1000 * rounds.get("wire_s", 0) / rounds["rounds"], 3)
        rounds["compute_ms_per_round"] = round(1000 * rounds.get("compute_s", 0) / rounds["rounds"], 3)
    print(f"{deployment} gamma {gamma}: {wall:.1f} s", file=sys.stderr)
    return _record(deployment, gamma, wall, outs, phases, after["steps"] - before["steps"], rounds or None)


def _processes(target_dir: str, draft_dir: str, prompts, gamma: int, threads: int) -> list[dict]:
    from benchmarks.launch import ServerProcess

    draft = ServerProcess("draft", "--model", draft_dir, "--port", "0", threads=threads)
    rows = []
    try:
        for g in (0, gamma):
            extra = ("--draft-server", draft.address) if g else ()
            target = ServerProcess("target", "--model", target_dir, "--port", "0", "--gamma", str(g),
                                   "--batch-size", "1", "--metrics-port", "0", *extra, threads=threads)
            try:
                rows.append(measure_deployment("processes", g, target.address, target.ready["metrics"], prompts))
            finally:
                target.terminate()
    finally:
        draft.terminate()
    return rows


def _ray(target_dir: str, draft_dir: str, prompts, gamma: int, threads: int) -> list[dict]:
    from controller.cluster.spec import local_ray_env

    local_ray_env()  # before Ray loads
    import ray

    from controller.cluster.local import local_spec, read_state, start_local, stop_local
    from controller.cluster.spec import CONTROLLER, NAMESPACE

    if read_state() is not None:
        raise RuntimeError("a starjar cluster is running: `starjar down` first (this benchmark starts its own)")
    spec = local_spec(target=target_dir, draft=draft_dir, targets=1, gamma=gamma, policy="fixed", batch_size=1,
                      threads=threads, draft_threads=threads, grpc_port=0, http_port=0)
    start_local(spec)
    rows = []
    try:
        state = read_state()
        ray.init(address=state["ray_address"], namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        controller = ray.get_actor(CONTROLLER)
        metrics = _target_metrics(state["addresses"]["metrics"])
        for g in (0, gamma):
            ray.get(controller.set_gamma.remote(g))
            rows.append(measure_deployment("ray", g, state["addresses"]["grpc"], metrics, prompts))
        rows.append(_beside_idle_cluster(target_dir, prompts, threads))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_local()
    return rows


def _beside_idle_cluster(target_dir: str, prompts, threads: int) -> dict:
    """A `serve target` process without drafts while the cluster idles beside it: what the cluster's mere
    presence costs a target, and how busy the cluster is at rest."""
    from benchmarks import background
    from benchmarks.launch import ServerProcess

    rest = background.sample(10.0)
    print(f"cluster at rest: {rest}", file=sys.stderr)
    target = ServerProcess("target", "--model", target_dir, "--port", "0", "--gamma", "0", "--batch-size", "1",
                           "--metrics-port", "0", threads=threads)
    try:
        row = measure_deployment(BESIDE, 0, target.address, target.ready["metrics"], prompts)
    finally:
        target.terminate()
    row["cluster_at_rest"] = rest
    return row


def _target_metrics(addresses: list[str]) -> str:
    """Which of the cluster's /metrics addresses is the target worker's."""
    from controller.cluster.local import cluster_token
    from starjar.service.metrics import scrape

    for a in addresses:
        if "starjar_target_decode_steps" in scrape(a, cluster_token()):
            return a
    raise RuntimeError(f"no target worker among the metrics endpoints {addresses}")


# ---- the summary ------------------------------------------------------------------------------------


def _speedups(runs: list[dict]) -> dict:
    by = {(r["deployment"], r["gamma"]): r for r in runs}
    out = {}
    for dep in ("co-located", "processes", "ray"):
        off, on = [by[(dep, g)] for g in sorted({g for d, g in by if d == dep})]
        out[dep] = round(off["wall_s"] / on["wall_s"], 3)
    if (BESIDE, 0) in by:  # above 1: the idle cluster slowed a process that is not part of it
        out["idle_cluster_slowdown"] = round(by[(BESIDE, 0)]["wall_s"] / by[("processes", 0)]["wall_s"], 3)
    return out


def _print(runs: list[dict], table: dict) -> None:
    print(f"\n{'deployment':11s} {'gamma':>5s} {'wall s':>7s} {'tok/s':>6s} {'prefill ms':>10s} "
          f"{'propose ms':>10s} {'verify ms':>9s} {'wire ms':>7s} {'same':>5s}", file=sys.stderr)
    for r in runs:
        wire = (r.get("draft_rounds") or {}).get("wire_ms_per_round")
        print(f"{r['deployment']:11s} {r['gamma']:5d} {r['wall_s']:7.1f} {r['tokens_per_s']:6.1f} "
              f"{r['ms_per_prompt_prefill']:10.1f} {r['ms_per_decode_step']['propose']:10.1f} "
              f"{r['ms_per_decode_step']['verify']:9.1f} {'' if wire is None else f'{wire:.2f}':>7s} "
              f"{r['identical']:5d}", file=sys.stderr)
    print("speedup (off / on): " + ", ".join(f"{k} {v:.2f}x" for k, v in table.items()), file=sys.stderr)

