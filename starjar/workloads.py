"""Workload files that live beside the repository in ../shared/data (or $STARJAR_DATA)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def data_dir() -> Path:
    env = os.environ.get("STARJAR_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def spec_bench_questions(limit: int | None = None, categories: set[str] | None = None) -> list[dict]:
    """Spec-Bench questions: dicts with question_id, category and turns (list of strings)."""
    path = data_dir() / "spec_bench" / "question.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path} (set STARJAR_DATA)")
    out = []
    with path.open() as f:
        for line in f:
            q = json.loads(line)
            if categories is None or q["category"] in categories:
                out.append(q)
            if limit is not None and len(out) >= limit:
                break
    return out


def spec_bench_prompts(limit: int | None = None) -> list[str]:
    """First turn of each Spec-Bench question, in file order."""
    return [q["turns"][0] for q in spec_bench_questions(limit)]


def spec_bench_mix(n: int) -> list[str]:
    """n first-turn prompts taken round-robin over Spec-Bench's categories (file order inside each)."""
    by_cat: dict[str, list[str]] = {}
    for q in spec_bench_questions():
        by_cat.setdefault(q["category"], []).append(q["turns"][0])
    out: list[str] = []
    for i in range(max(len(v) for v in by_cat.values())):
        for prompts in by_cat.values():
            if i < len(prompts) and len(out) < n:
                out.append(prompts[i])
    return out
