"""`starjar generate` as a user runs it: a real subprocess, JSONL in, JSONL out."""

import json
import subprocess
import sys

import pytest

from benchmarks.fixtures.reference import hf_greedy
from starjar import workloads


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "controller.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_jsonl_in_order_and_exact(tmp_path, model_dirs, models):
    # The short categories: the tiny model's context is 512 tokens of a small vocabulary.
    prompts = workloads.texts(workloads.load("own", 7, categories={"qa", "translation", "writing"}))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--gamma", "3",
                   "--max-tokens", "24", "--batch-size", "3", "--prompts", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "acceptance" in proc.stderr and "7 requests" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    tok = models["llama"].tokenizer
    for r in rows:
        assert set(r) == {"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}
        assert r["prompt_token_ids"] == tok(r["prompt"])["input_ids"]
        assert r["token_ids"] == hf_greedy(models["llama"], r["prompt_token_ids"], 24)
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True)
        assert r["finish_reason"] in ("stop", "length")


def test_generate_chat_and_sampling(tmp_path, model_dirs, models):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Tell me a joke"}\n{"prompt": "Why is the sky blue?"}\n')
    outs = []
    for i in range(2):
        out = tmp_path / f"out{i}.jsonl"
        proc = run_cli("generate", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--chat",
                       "--temperature", "0.8", "--top-k", "50", "--seed", "3", "--max-tokens", "12",
                       "--prompts", str(src), "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert outs[0] == outs[1]  # seeded: the same again
    chat_ids = models["llama"].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a joke"}], add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert outs[0][0]["prompt_token_ids"] == list(chat_ids)


def test_gamma_zero_is_target_alone(tmp_path, model_dirs, models):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Count to ten"}\n')
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "--target", model_dirs["llama"], "--draft", model_dirs["other_tok"], "--gamma", "0",
                   "--prompts", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr  # the draft is not even loaded
    row = json.loads(out.read_text())
    assert row["token_ids"] == hf_greedy(models["llama"], row["prompt_token_ids"], 64)


def _fake_run(label: str) -> dict:
    return {"label": label, "results": [{"ids": [5, 6]}], "events": [(0.1, 1), (0.2, 1)], "wall": 1.0, "tokens": 2,
            "tok_s": 2.0, "ttft": [0.1], "tpot": [0.1], "accept": None}


def test_demo_without_matplotlib_prints_its_table_then_says_the_plot_needs_the_bench_extra(
        monkeypatch, capsys, tmp_path):
    import argparse

    import ray

    from controller.cli import demo
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the bench extra were not installed
    spec = {"targets": 1, "batch_size": 1, "draft": "d", "target": "t", "policy": "fixed", "gamma": 1}

    class Controller:  # ray.get_actor's answer: describe.remote() -> the spec (ray.get is the identity here)
        describe = type("Method", (), {"remote": staticmethod(lambda: spec)})

    monkeypatch.setattr(demo, "_cluster", lambda args: ({"ray_address": "-", "addresses": {"grpc": "-"}}, False, None))
    monkeypatch.setattr(demo, "_both_runs", lambda *a: (_fake_run("speculation off"), _fake_run("on")))
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "get_actor", lambda *a, **kw: Controller)
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    plot = tmp_path / "demo.png"
    args = argparse.Namespace(requests=1, rate=1.0, max_tokens=2, seed=0, plot=str(plot), keep=False, prompts=None)
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    assert "identical outputs 1/1" in out and "speculation off" in out
    assert out.index("identical outputs") < out.index("it needs matplotlib") and "starjar[bench]" in out
    assert not plot.exists()


def test_old_flag_spellings_still_work_and_warn(capsys):
    from controller.cli.main import _parser

    args = _parser().parse_args(["serve", "target", "--draft", "127.0.0.1:1"])
    assert args.draft_server == "127.0.0.1:1"
    assert "--draft is deprecated, use --draft-server" in capsys.readouterr().err
    args = _parser().parse_args(["serve", "draft", "--max-sequences", "3"])
    assert args.max_sequences_per_target == 3
    assert "--max-sequences is deprecated, use --max-sequences-per-target" in capsys.readouterr().err


def test_a_config_error_names_the_flag(capsys):
    from controller.cli.main import main

    assert main(["serve", "target", "--draft-deadline", "0"]) == 2
    assert "invalid --draft-deadline: must be > 0" in capsys.readouterr().err
    assert main(["serve", "draft", "--lease", "0"]) == 2
    assert "invalid --lease: must be > 0" in capsys.readouterr().err
    assert main(["serve", "draft", "--max-batch-rounds", "0"]) == 2
    assert "invalid --max-batch-rounds: must be in [1, 4096]" in capsys.readouterr().err


def test_the_draft_servers_batch_cap_reaches_its_config():
    from controller.cli.main import _parser
    from controller.cli.serve import _draft_config

    assert _draft_config(_parser().parse_args(["serve", "draft"])).max_batch_rounds == 64
    assert _draft_config(_parser().parse_args(["serve", "draft", "--max-batch-rounds", "4"])).max_batch_rounds == 4


def test_up_gives_its_draft_servers_the_batch_cap(model_dirs, tmp_path, monkeypatch):
    """`starjar up --max-batch-rounds N` reaches the ClusterSpec every draft server actor builds its config from
    (before, only `serve draft` took the cap); a bad value is refused naming the flag, before anything starts."""
    from controller.cli.main import _parser
    from controller.cli.up import _spec
    from starjar.errors import InvalidArgument

    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    base = ["up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--gamma", "2"]
    assert _spec(_parser().parse_args(base)).draft_server_config().max_batch_rounds == 64
    assert _spec(_parser().parse_args([*base, "--max-batch-rounds", "4"])).draft_server_config().max_batch_rounds == 4
    with pytest.raises(InvalidArgument, match="--max-batch-rounds"):
        _spec(_parser().parse_args([*base, "--max-batch-rounds", "0"]))


def test_sharing_and_http_limits_reach_every_server_from_one_declaration(model_dirs, tmp_path, monkeypatch):
    """The draft server's sharing settings are the same flags on `serve draft` and `up`, with the dataclass's
    defaults; on `up` they and the HTTP limits travel in the ClusterSpec to the configs the actors build, and a
    bad value is refused naming the flag before anything starts."""
    from controller.cli.main import _parser
    from controller.cli.serve import _draft_config
    from controller.cli.up import _spec
    from controller.cluster.spec import ClusterSpec
    from draft_server.config import DraftServerConfig
    from starjar.errors import InvalidArgument

    default = DraftServerConfig()
    cfg = _draft_config(_parser().parse_args(["serve", "draft"]))
    assert (cfg.max_targets_per_caller, cfg.reclaim_after_s, cfg.pass_catchup_tokens) == (
        default.max_targets_per_caller, default.reclaim_after_s, default.pass_catchup_tokens)
    cfg = _draft_config(_parser().parse_args(["serve", "draft", "--max-targets-per-caller", "3",
                                              "--reclaim-after", "0.5", "--pass-catchup-tokens", "64"]))
    assert (cfg.max_targets_per_caller, cfg.reclaim_after_s, cfg.pass_catchup_tokens) == (3, 0.5, 64)
    assert default.lookahead == "off"
    assert _draft_config(_parser().parse_args(["serve", "draft", "--lookahead", "chain"])).lookahead == "chain"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        _parser().parse_args(["serve", "draft", "--lookahead", "tree"])

    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    base = ["up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--gamma", "2"]
    spec = ClusterSpec.from_dict(_spec(_parser().parse_args(
        [*base, "--max-targets-per-caller", "4", "--pass-catchup-tokens", "128", "--lookahead", "chain",
         "--header-timeout", "3",
         "--max-body-bytes", "65536"])).to_dict())  # as the actors get it
    cfg = spec.draft_server_config("10.0.0.1")
    assert (cfg.host, cfg.max_targets_per_caller, cfg.pass_catchup_tokens, cfg.max_batch_rounds, cfg.lookahead) == (
        "10.0.0.1", 4, 128, 64, "chain")
    limits = spec.http_limits()
    assert (limits.header_timeout_s, limits.max_body_bytes, limits.body_timeout_s) == (3.0, 65536, 30.0)
    assert _spec(_parser().parse_args(base)).draft_server_config().reclaim_after_s == default.reclaim_after_s
    for flag, bad in (("--reclaim-after", "-1"), ("--max-targets-per-caller", "0"), ("--header-timeout", "0"),
                      ("--max-body-bytes", "0")):
        with pytest.raises(InvalidArgument, match=flag):
            _spec(_parser().parse_args([*base, flag, bad]))


@pytest.mark.parametrize("lookahead", ["off", "chain"])
def test_demo_hands_its_lookahead_to_the_draft_servers_config(monkeypatch, lookahead):
    """`starjar demo --lookahead chain` starts the cluster's draft server with chain lookahead; off leaves its
    default."""
    import argparse

    from controller.cli import demo
    from controller.cluster import local

    started = []
    monkeypatch.setattr(local, "read_state", lambda: None if not started else {"addresses": {}})
    monkeypatch.setattr(local, "start_local", started.append)
    chosen = type("Chosen", (), {"speculates": True, "gamma": 3, "policy": "nightjar", "note": ""})
    monkeypatch.setattr(local, "adaptive_defaults", lambda *a: chosen)
    monkeypatch.setattr(local, "local_spec", lambda **fields: fields)
    parser = argparse.ArgumentParser()
    demo.add_demo_parser(parser.add_subparsers())
    args = parser.parse_args(["demo", "--lookahead", lookahead])
    demo._cluster(args)
    assert started[0]["draft_server"] == ({"lookahead": "chain"} if lookahead == "chain" else {})
