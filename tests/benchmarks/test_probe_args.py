"""A probe's command line (benchmarks.common.rounds_args): a round count under 1 is refused, naming the flag."""

import sys

import pytest

from benchmarks.common import rounds_args


def test_rounds_under_one_are_refused_with_the_flag_and_the_value(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["probe", "--rounds", "0", "--out", "x.json"])
    with pytest.raises(SystemExit) as exit_:
        rounds_args("A probe.\n", 6, "a round")
    assert exit_.value.code == 2 and "--rounds must be at least 1 (got 0)" in capsys.readouterr().err


def test_the_default_and_the_out_path_are_taken(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["probe", "--out", "x.json"])
    args = rounds_args("A probe.\n", 6, "a round")
    assert (args.rounds, args.out) == (6, "x.json")


@pytest.mark.parametrize("flag,value", [("--rounds", "0"), ("--threads", "0")])
def test_the_int8_twin_probe_refuses_counts_under_one_before_loading_anything(monkeypatch, capsys, flag, value):
    from benchmarks.probes import int8_twin_speed

    monkeypatch.setattr(sys, "argv", ["probe", flag, value, "--out", "x.json"])
    with pytest.raises(SystemExit) as exit_:
        int8_twin_speed.main()
    assert exit_.value.code == 2 and f"{flag} must" in capsys.readouterr().err
