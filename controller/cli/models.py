"""`starjar models build` and `starjar profile`: the default model pair, and the latency tables the planners
load. The work is pair_check's and profiler's; this file reads flags and prints."""

from __future__ import annotations

import json
import sys
import time


def add_models_parsers(sub) -> None:
    m = sub.add_parser("models", help="the default model pair")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    b = msub.add_parser("build", help="build (or find cached) the default pair offline")
    b.add_argument("--json", action="store_true", help='print {"target": DIR, "draft": DIR}')
    b.add_argument("--force", action="store_true", help="rebuild even if cached")

    pr = sub.add_parser("profile", help="profile C_switch(L_max, B), T(n) and D0 for the planners")
    pr.add_argument("--target", help="target model directory (default: the default pair's target)")
    pr.add_argument("--draft", help="draft model directory (default: the default pair's draft)")
    pr.add_argument("--out", required=True, help="JSON to write (load it with --profile)")
    pr.add_argument("--quick", action="store_true", help="a smaller grid")


def run_models_build(args) -> int:
    from controller.tuning.pair_check import measured_acceptance
    from starjar.model.default_pair import build_default_pair

    t0 = time.time()
    pair = build_default_pair(force=args.force)
    check = measured_acceptance(pair["target"], pair["draft"], force=args.force)
    if args.json:
        print(json.dumps({**pair, "acceptance": check.get("acceptance_rate"), "measured": check}))
        return 0
    acc, machine = check.get("acceptance_rate"), check["machine"]
    print(f"target: {pair['target']}\ndraft:  {pair['draft']}\n"
          f"machine: {machine['cpu_model']} ({machine['cpu_capability']}, {machine['threads']} threads"
          + "".join(f", {k}={v}" for k, v in (machine.get("isa_limits") or {}).items()) + ")\n"
          f"chosen draft: {check['chosen']['name']}\n"
          + (f"acceptance at gamma {check['confirm_gamma']}: {acc:.2f} ({check['prompts']} prompts of our own, "
             f"greedy)\n" if acc is not None else "")
          + f"default gamma: {check['gamma']} ({check['verdict']})\n({time.time() - t0:.1f} s)")
    return 0


def run_profile_cmd(args) -> int:
    from controller.cli.flags import check_output_path
    from controller.tuning.profiler import profile_to_file

    check_output_path("--out", args.out)
    result = profile_to_file(args.target, args.draft, args.out, quick=args.quick)
    print(f"wrote {args.out}: D0 {result['d0_s'] * 1000:.1f} ms, T(1) {result['t_of_n']['1'] * 1000:.1f} ms",
          file=sys.stderr)
    return 0
