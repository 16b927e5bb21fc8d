"""Pieces every benchmark shares: the pair, the prompts, target continuations, a plot helper."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from starjar import workloads
from starjar.model.text import encode_prompt
from starjar.spec.sampling import SamplingParams

MAX_PROMPT_TOKENS = 1024  # serving benchmarks' usual cap on a sampled ShareGPT prompt (and at least 4 tokens)


def pair_dirs(args) -> tuple[str, str, str]:
    """(target dir, draft dir, a note saying which draft this is)."""
    if getattr(args, "target", None) and getattr(args, "draft", None):
        return args.target, args.draft, "given on the command line"
    from starjar.model.default_pair import DRAFT_NOTE, build_default_pair

    pair = build_default_pair()
    note = f"default pair; draft: {DRAFT_NOTE}"
    return args.target or pair["target"], args.draft or pair["draft"], note


def prompt_texts(args, n: int, default: str = "own", categories: set[str] | None = None) -> list[workloads.Prompt]:
    """n prompts of the workload the flags name (--dataset, --dataset-path), else of `default`."""
    dataset = getattr(args, "dataset", None) or default
    return workloads.load(dataset, n, getattr(args, "dataset_path", None), categories)


def prompt_ids(tokenizer, n: int, args=None) -> list[list[int]]:
    """n tokenized prompts for a serving benchmark: ShareGPT unless the flags name another workload, each through
    the chat template with --chat. ShareGPT's sample skips prompts under 4 or over MAX_PROMPT_TOKENS tokens, as
    serving benchmarks do."""
    dataset = getattr(args, "dataset", None) or "sharegpt"
    chat = bool(getattr(args, "chat", False))
    if dataset != "sharegpt":
        return [encode_prompt(tokenizer, p.text, chat) for p in prompt_texts(args, n, dataset)]
    out: list[list[int]] = []
    for p in workloads.load("sharegpt", 8 * n + 64, getattr(args, "dataset_path", None)):
        ids = encode_prompt(tokenizer, p.text, chat)
        if 4 <= len(ids) <= MAX_PROMPT_TOKENS:
            out.append(ids)
        if len(out) == n:
            break
    return out


def target_continuations(target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's own greedy output (what replay targets verify against)."""
    from controller.colocated import colocated_engine

    reqs = colocated_engine(target, None, 0, len(prompts)).generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                                                            ignore_eos=True))
    return [r.output_ids for r in reqs]


def p50(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def save_plot(path: Path, title: str, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str) -> str | None:
    """A line plot as PNG; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def rounds_args(doc: str, default: int, what: str) -> argparse.Namespace:
    """A probe's command line: --rounds (at least 1; each `what`) and --out, the result JSON."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=default, help=f"rounds, each {what} (default {default})")
    ap.add_argument("--out", required=True, help="result JSON (benchmarks/results/<machine kind>/...)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {args.rounds})")
    args.error = ap.error
    return args


def write_result(path: str, result: dict, summary: str) -> None:
    """A probe's result JSON written to path, its one-line summary and where it went printed."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(summary)
    print(f"wrote {path}")
