"""The `starjar` command line.

  starjar demo                       the README's first command: default pair, a short workload, a summary
  starjar generate ...               batch generation from a JSONL file (co-located draft)
  starjar serve draft|target ...     one gRPC server in the foreground
  starjar up [--json] / starjar down  a cluster on Ray: draft server, target workers, front end
  starjar models build [--json]      build the default pair offline and print where it is
  starjar profile --out F.json       C_switch, T(n) and D0 for the planners (--policy nightjar|tide)
  starjar bench NAME [--quick] --out F.json   (the benchmarks' own command, starjar-bench)

This file only reads the command line and hands each command to its module;
errors in what the user gave print one line naming the field and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from controller.cli.demo import add_demo_parser
from controller.cli.generate import add_generate_parser
from controller.cli.models import add_models_parsers
from controller.cli.serve import add_serve_parsers
from controller.cli.up import add_up_parsers
from controller.cluster.omp_env import share_cores
from starjar.errors import InvalidArgument, StarjarError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="starjar", description="speculative decoding as a shared service")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_generate_parser(sub)
    add_models_parsers(sub)
    # Everything after `bench` goes to the benchmarks' own parser (`starjar bench -h` shows it).
    be = sub.add_parser("bench", add_help=False, prefix_chars="\0",
                        help="run a benchmark and write its results as JSON (starjar bench -h: its flags)")
    be.add_argument("bench_args", nargs=argparse.REMAINDER)
    add_serve_parsers(sub)
    add_up_parsers(sub)
    add_demo_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    share_cores()  # before torch loads: servers, benchmarks and the demo's processes take turns on the cores
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        if args.cmd == "bench":
            from benchmarks.cli import main as bench_main  # benchmark code loads only for this command

            return bench_main(args.bench_args, prog="starjar bench")
        return _run(args)
    except InvalidArgument as exc:
        print(f"starjar: error: {exc}", file=sys.stderr)
        return 2
    except StarjarError as exc:
        print(f"starjar: error: {exc}", file=sys.stderr)
        return 1


def _run(args) -> int:
    if args.cmd == "generate":
        from controller.cli.generate import run_generate
        return run_generate(args)
    if args.cmd == "models":
        from controller.cli.models import run_models_build
        return run_models_build(args)
    if args.cmd == "serve":
        from controller.cli.serve import run_serve
        return run_serve(args)
    if args.cmd == "profile":
        from controller.cli.models import run_profile_cmd
        return run_profile_cmd(args)
    if args.cmd in ("up", "down"):
        from controller.cli.up import run_down, run_up
        return run_up(args) if args.cmd == "up" else run_down(args)
    if args.cmd == "demo":
        from controller.cli.demo import run_demo
        return run_demo(args)
    return 2


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
