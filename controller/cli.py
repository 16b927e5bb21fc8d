"""The `starjar` command line.

  starjar demo                       the README's first command: default pair, a short workload, a summary
  starjar generate ...               batch generation from a JSONL file (co-located draft)
  starjar serve draft|target ...     one gRPC server in the foreground
  starjar up [--json] / starjar down  a cluster on Ray: draft server, target workers, front end
  starjar models build [--json]      build the default pair offline and print where it is
  starjar profile --out F.json       C_switch, T(n) and D0 for the planners (--policy nightjar|tide)
  starjar bench NAME [--quick] --out F.json

Errors in what the user gave print one line naming the field and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from starjar.errors import InvalidArgument, StarjarError

log = logging.getLogger("starjar")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (default: the default pair's target)")
    p.add_argument("--draft", help="draft model directory (default: none; target alone)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="starjar", description="speculative decoding as a shared service")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate for every prompt of a JSONL file")
    _add_model_args(g)
    g.add_argument("--prompts", required=True, help='input JSONL, one {"prompt": "..."} per line')
    g.add_argument("--out", required=True, help="output JSONL, one result per input line, same order")
    g.add_argument("--gamma", type=int, default=4, help="draft tokens per step; 0 = target alone (default 4)")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    g.add_argument("--seed", type=int, default=None, help="base seed; prompt i uses seed + i")
    g.add_argument("--batch-size", type=int, default=16, help="cap on the running batch (default 16)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    g.add_argument("--policy", default="fixed",
                   help="fixed (gamma every step) or a planner picking gamma in 0..--gamma: nightjar, dsd, "
                        "banditspec, tide, vllm_table, sglang_ema, hf_heuristic")
    g.add_argument("--profile", default=None, help="latency tables from `starjar profile` (nightjar, tide)")

    pr = sub.add_parser("profile", help="profile C_switch(L_max, B), T(n) and D0 for the planners")
    pr.add_argument("--target", help="target model directory (default: the default pair's target)")
    pr.add_argument("--draft", help="draft model directory (default: the default pair's draft)")
    pr.add_argument("--out", required=True, help="JSON to write (load it with --profile)")
    pr.add_argument("--quick", action="store_true", help="a smaller grid")

    m = sub.add_parser("models", help="the default model pair")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    b = msub.add_parser("build", help="build (or find cached) the default pair offline")
    b.add_argument("--json", action="store_true", help='print {"target": DIR, "draft": DIR}')
    b.add_argument("--force", action="store_true", help="rebuild even if cached")

    be = sub.add_parser("bench", help="run a benchmark and write its results as JSON")
    be.add_argument("name", help="benchmark name: core, tax, star, cluster, draft, api, nightjar, offload, faults")
    be.add_argument("--quick", action="store_true", help="a small version for smoke runs")
    be.add_argument("--replay", action="store_true", help="replay targets (bench star): simulated target compute")
    be.add_argument("--real", action="store_true", help="bench nightjar: also run a subset on the real models")
    be.add_argument("--out", required=True, help="results JSON path")
    be.add_argument("--target", help="target model directory (default: the default pair)")
    be.add_argument("--draft", help="draft model directory (default: the default pair)")

    from controller.serve_cmd import add_serve_parsers

    add_serve_parsers(sub)
    from controller.up_cmd import add_up_parsers

    add_up_parsers(sub)
    g.add_argument("--draft-server", help="use a running draft server HOST:PORT instead of --draft")

    from controller.demo import add_demo_parser

    add_demo_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        if args.cmd == "generate":
            from controller.generate_cmd import run_generate
            return run_generate(args)
        if args.cmd == "models":
            return _models_build(args)
        if args.cmd == "bench":
            from benchmarks.registry import run_bench
            return run_bench(args)
        if args.cmd == "serve":
            # Servers share cores with each other on one host: OpenMP threads that spin after
            # each op steal them (a remote draft lost 8% of target speed that way). Must be
            # set before torch loads.
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            from controller.serve_cmd import run_serve
            return run_serve(args)
        if args.cmd == "profile":
            return _profile(args)
        if args.cmd in ("up", "down"):
            from controller.up_cmd import run_down, run_up
            return run_up(args) if args.cmd == "up" else run_down(args)
        if args.cmd == "demo":
            from controller.demo import run_demo
            return run_demo(args)
    except InvalidArgument as exc:
        print(f"starjar: error: {exc}", file=sys.stderr)
        return 2
    except StarjarError as exc:
        print(f"starjar: error: {exc}", file=sys.stderr)
        return 1
    return 2


def _models_build(args) -> int:
    from controller.pair_check import measured_acceptance
    from starjar.default_pair import build_default_pair

    t0 = time.time()
    pair = build_default_pair(force=args.force)
    check = measured_acceptance(pair["target"], pair["draft"], force=args.force)
    if args.json:
        print(json.dumps({**pair, "acceptance": check.get("acceptance_rate"), "measured": check}))
    else:
        acc = check.get("acceptance_rate")
        print(f"target: {pair['target']}\ndraft:  {pair['draft']}\n"
              f"machine: {check['machine']['cpu_model']} ({check['machine']['cpu_capability']}, "
              f"{check['machine']['threads']} threads)\n"
              f"chosen draft: {check['chosen']['name']}\n"
              + (f"acceptance at gamma {check['confirm_gamma']}: {acc:.2f} ({check['prompts']} prompts of our own, "
                 f"greedy)\n" if acc is not None else "")
              + f"default gamma: {check['gamma']} ({check['verdict']})\n({time.time() - t0:.1f} s)")
    return 0


def _profile(args) -> int:
    from controller.colocated import load_pair
    from controller.profiler import run_profile
    from starjar.default_pair import build_default_pair

    if args.target is None or args.draft is None:
        pair = build_default_pair()
        args.target, args.draft = args.target or pair["target"], args.draft or pair["draft"]
    target, draft = load_pair(args.target, args.draft)
    result = run_profile(target, draft, quick=args.quick)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}: D0 {result['d0_s'] * 1000:.1f} ms, T(1) {result['t_of_n']['1'] * 1000:.1f} ms",
          file=sys.stderr)
    return 0


def _quiet_libraries() -> None:
    # transformers prints weight-loading bars on every load; our own bars say what matters.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
