"""Workloads come from the repository or from packages, never from a folder beside the clone."""

from __future__ import annotations

import json

import pytest

from starjar import workloads
from starjar.errors import InvalidArgument

CATEGORIES = {"translation", "summarization", "qa", "math_reasoning", "rag", "extraction", "coding", "writing"}


def test_own_prompts_ship_in_the_package():
    ps = workloads.own_prompts()
    assert {p.category for p in ps} == CATEGORIES
    assert all(sum(p.category == c for p in ps) >= 5 for c in CATEGORIES)
    assert len({p.text for p in ps}) == len(ps) and all(len(p.text) > 20 for p in ps)
    assert workloads.own_prompts({"qa"}) == [p for p in ps if p.category == "qa"]


def test_mix_is_round_robin_over_categories_and_cycles():
    ps = workloads.own_prompts()
    n_cat = len(CATEGORIES)
    first = workloads.mix(ps, n_cat)
    assert {p.category for p in first} == CATEGORIES
    assert workloads.mix(ps, 2 * n_cat)[n_cat:] == [next(q for q in ps if q.category == p.category and q != p)
                                                     for p in first]
    assert workloads.mix(ps, len(ps) + 3)[-3:] == workloads.mix(ps, 3)
    assert workloads.load("own", 40) == workloads.mix(ps, 40)


def test_spec_bench_file_is_read_where_the_user_names_it(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": 1, "category": "qa", "turns": ["first?", "second?"]},
            {"question_id": 2, "category": "rag", "turns": ["third?"]}, {"category": "qa", "prompt": "fourth?"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert workloads.texts(workloads.load("spec-bench", None, path)) == ["first?", "third?", "fourth?"]
    assert workloads.texts(workloads.load("spec-bench", None, path, {"qa"})) == ["first?", "fourth?"]
    assert workloads.texts(workloads.load("spec-bench", 4, path)) == ["first?", "third?", "fourth?", "first?"]


@pytest.mark.parametrize("dataset, path, field", [
    ("spec-bench", None, "dataset_path"),  # no file named
    ("spec-bench", "missing.jsonl", "dataset_path"),
    ("nope", None, "dataset"),
])
def test_bad_workload_arguments_name_the_field(tmp_path, dataset, path, field):
    with pytest.raises(InvalidArgument) as e:
        workloads.load(dataset, 4, None if path is None else tmp_path / path)
    assert e.value.field == field


def test_a_line_that_is_not_a_question_names_its_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["ok"]}\n{"turns": []}\n')
    with pytest.raises(InvalidArgument, match="line 2"):
        workloads.spec_bench_prompts(path)


def test_sharegpt_comes_from_its_package_and_is_seeded():
    a = workloads.sharegpt_prompts(20, seed=0)
    assert len(a) == 20 and all(p.text and p.output_tokens >= 1 for p in a)
    assert a == workloads.sharegpt_prompts(20, seed=0) and a != workloads.sharegpt_prompts(20, seed=1)


def test_a_json_array_cut_short_keeps_every_whole_record():
    whole = [{"id": k, "conversations": [{"from": "human", "value": f"q{k}"}]} for k in range(3)]
    text = json.dumps(whole)
    assert workloads._json_array_prefix(text) == whole
    assert workloads._json_array_prefix(text[: text.rindex("{") + 12]) == whole[:2]


def test_sharegpt_from_a_given_file(tmp_path):
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x" * 40}]},
             {"id": "b", "conversations": [{"from": "human", "value": "alone"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    got = workloads.load("sharegpt", 5, path)
    assert [(p.text, p.output_tokens) for p in got] == [("hi", 10)]


def test_the_bench_cli_refuses_spec_bench_without_a_file(capsys):
    from benchmarks.cli import main

    assert main(["core", "--dataset", "spec-bench", "--out", "/dev/null", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "dataset_path" in err and "Traceback" not in err
