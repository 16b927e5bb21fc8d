"""bench lookahead: a run on tiny models (the target alone, lookahead off, chain and fanout, at batch 2), and its server
start-up: a draft server that fails to start leaves none running."""

import os

import pytest
import torch

from benchmarks import launch, lookahead
from benchmarks.cli import parser
from starjar.errors import InvalidArgument
from tests.helpers.affinity import restore_cores


class _Server:
    """Stands in for a draft server process; the second one fails to start (fault injection)."""

    started: list["_Server"] = []

    def __init__(self, *args, threads: int = 1):
        if len(_Server.started) == 1:
            raise RuntimeError("draft server exited before it was ready")
        self.terminated = False
        _Server.started.append(self)

    def terminate(self) -> int:
        self.terminated = True
        return 0


@pytest.mark.parametrize("pin", [False, True])
def test_a_failed_start_stops_the_servers_already_running(monkeypatch, pin):
    if pin and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin needs two cores")
    cores = os.sched_getaffinity(0)
    _Server.started = []
    monkeypatch.setattr(launch, "ServerProcess", _Server)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    try:
        with pytest.raises(RuntimeError, match="before it was ready"):
            launch.start_draft_servers("unused", lookahead.MODES, 1, pin)
    finally:  # --pin narrows every thread of this process: give them all their cores back
        restore_cores(cores)
    assert len(_Server.started) == 1 and _Server.started[0].terminated


def test_a_quick_run_at_batch_2_compares_with_the_target_alone(tmp_path):
    from benchmarks.fixtures.tiny_models import make_tiny_model

    # The tiny tokenizer spends a token on every few bytes: a context the longest own prompt fits in.
    target = make_tiny_model(tmp_path / "target", "llama", seed=0, max_context=4096)
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=0, layers=1, max_context=4096, tokenizer_from=target)
    args = parser().parse_args(["lookahead", "--quick", "--batch-size", "2", "--dataset", "own", "--lookahead",
                                "fanout", "--target", str(target), "--draft", str(draft), "--out", "unused.json"])
    result = lookahead.run(args)
    assert result["workload"]["batch_size"] == 2 and result["outputs_identical"]
    assert set(result["runs_tokens_per_s"]) == {"alone", "off", "chain", "fanout"}
    assert all(len(runs) == 2 and min(runs) > 0 for runs in result["runs_tokens_per_s"].values())
    assert result["chain_over_alone"] == pytest.approx(result["chain_tokens_per_s"] / result["alone_tokens_per_s"],
                                                       rel=1e-3)  # a ratio of the unrounded rates
    assert result["target_phases_s"]["alone"]["propose_s"] == 0
    # Decode rates leave the target's prefill out, so each is above its mode's tokens/s.
    for way, runs in result["runs_decode_tokens_per_s"].items():
        assert all(d > r for d, r in zip(runs, result["runs_tokens_per_s"][way], strict=True))
    decode = result["decode_tokens_per_s"]
    assert result["decode_ratio"] == pytest.approx(decode["chain"] / decode["off"], rel=1e-3)  # of unrounded rates
    fan = result["fanout"]
    assert fan["decode_over_chain"] == pytest.approx(decode["fanout"] / decode["chain"], rel=1e-3)
    assert fan["lookahead_hits"] + fan["lookahead_misses"] > 0 and fan["lookahead_branch_hits"] <= fan["lookahead_hits"]


def test_batch_size_must_be_positive():
    args = parser().parse_args(["lookahead", "--batch-size", "0", "--out", "unused.json"])
    with pytest.raises(InvalidArgument, match="batch-size"):
        lookahead.run(args)


def test_chat_prompts_go_through_the_chat_template(tmp_path):
    from benchmarks.common import prompt_ids, prompt_texts
    from benchmarks.fixtures.tiny_models import make_tiny_model
    from starjar.model.loading import load_model

    tok = load_model(make_tiny_model(tmp_path / "m", "llama", seed=0)).tokenizer
    raw, chat = (prompt_ids(tok, 2, parser().parse_args(["lookahead", "--dataset", "own", *flag, "--out", "x"]))
                 for flag in ([], ["--chat"]))
    texts = [p.text for p in prompt_texts(parser().parse_args(["lookahead", "--out", "x"]), 2, "own")]
    assert raw == [tok(t)["input_ids"] for t in texts]
    assert chat == [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"] for t in texts]
