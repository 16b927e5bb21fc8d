"""`bench core`'s batch-1 decode figures: the best gamma over gamma 0 and over llama.cpp's tg128."""

import argparse
import json
import stat

from benchmarks import core


def _runs():
    rows = [(0, 30.0), (1, 40.0), (2, 52.0), (3, 48.0)]
    return [{"batch_size": 1, "gamma": g, "decode_tokens_per_s": t} for g, t in rows] + [
        {"batch_size": 4, "gamma": 2, "decode_tokens_per_s": 99.0}]  # another batch size is not batch 1's best


def test_the_best_batch1_gamma_over_the_target_alone_and_llama_cpp():
    got = core._decode_batch1(_runs(), [38.0, 42.0])
    assert (got["best_gamma"], got["best_tokens_per_s"]) == (2, 52.0)
    assert got["best_over_target_alone"] == round(52 / 30, 3)
    assert got["best_over_llama_cpp"] == round(52 / 40, 3) and got["target_alone_over_llama_cpp"] == 0.75
    assert "best_over_llama_cpp" not in core._decode_batch1(_runs(), [])


def test_llama_bench_runs_only_when_both_paths_are_given(tmp_path):
    bench = tmp_path / "llama-bench"  # stands in for llama.cpp's binary: prints its JSON and checks its flags
    bench.write_text("#!/bin/sh\ncase \"$*\" in *'-p 0 -n 128'*'-o json'*) echo '" + json.dumps([{"avg_ts": 41.5}])
                     + "';; *) exit 2;; esac\n")
    bench.chmod(bench.stat().st_mode | stat.S_IEXEC)
    assert core._llama_cpp(argparse.Namespace(llama_bench=str(bench), gguf=None)) == []
    assert core._llama_cpp(argparse.Namespace(llama_bench=str(bench), gguf=str(tmp_path / "m.gguf"))) == [41.5]
