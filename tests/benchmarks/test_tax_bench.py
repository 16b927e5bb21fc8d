"""bench tax: a quick run on tiny models, the draft server sharing the cores and pinned to one of its own."""

import os

import pytest
import torch

from benchmarks import tax
from benchmarks.cli import parser
from tests.helpers.affinity import restore_cores


@pytest.mark.parametrize("pin", [False, True])
def test_a_quick_run_compares_remote_with_colocated(tmp_path, pin):
    from benchmarks.fixtures.tiny_models import make_tiny_model

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if pin and len(cores) < 2:
        pytest.skip("--pin needs two cores")
    target = make_tiny_model(tmp_path / "target", "llama", seed=0, max_context=4096)
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=0, layers=1, max_context=4096, tokenizer_from=target)
    flags = ["tax", "--quick", "--dataset", "own", "--lookahead", "chain", "--target", str(target), "--draft",
             str(draft), "--out", "unused.json"]
    try:  # pinned, at the gamma a remote draft with a core of its own may take
        result = tax.run(parser().parse_args(flags + (["--pin", "--gamma", "3"] if pin else [])))
    finally:  # --pin narrows every thread of this process to one core and torch to one thread: undo both
        torch.set_num_threads(threads)
        restore_cores(cores)
    assert result["outputs_identical"] and result["workload"]["pinned"] == pin
    assert result["workload"]["gamma"] == (3 if pin else tax.DEFAULT_GAMMA)
    # The ratios are of the unrounded rates: equal to the printed rates' within their rounding.
    assert result["ratio"] == pytest.approx(result["remote_tokens_per_s"] / result["colocated_tokens_per_s"], rel=1e-3)
    # Decode rates leave the target's prefill out: above the end-to-end rates.
    assert result["remote_decode_tokens_per_s"] > result["remote_tokens_per_s"] > 0
    assert result["colocated_decode_tokens_per_s"] > result["colocated_tokens_per_s"] > 0
    assert result["decode_ratio"] == pytest.approx(result["remote_decode_tokens_per_s"]
                                                   / result["colocated_decode_tokens_per_s"], rel=1e-3)


@pytest.mark.parametrize("gamma", ["0", "-1", str(tax.MAX_GAMMA + 1)])
def test_a_gamma_out_of_range_is_named_before_anything_loads(gamma):
    from starjar.errors import InvalidArgument

    args = parser().parse_args(["tax", "--gamma", gamma, "--target", "/nonexistent", "--out", "unused.json"])
    with pytest.raises(InvalidArgument, match="--gamma"):
        tax.run(args)
