"""--tree as a user runs it: `starjar serve target --tree ...` against a real `starjar serve draft` process,
the flags' validation, and the profiled verification budget reaching the tree selection."""

import json

import pytest

from benchmarks.launch import ServerProcess
from controller.cli.flags import tree_speculation
from controller.cluster.spec import ClusterSpec
from starjar import Client
from starjar.errors import InvalidArgument
from starjar.service.metrics import scrape
from starjar.spec.tree_select import TREE_MAX_DEPTH
from target_worker.tree_budget import measure_verify_budget, profiled_budget, tree_config

MAX_TOKENS = 32


def _scrape(address: str) -> dict[str, float]:
    text = scrape(address)
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("starjar_target_") and "{" not in line}


def test_serve_target_with_tree_flag_over_the_real_draft_server(tmp_path, model_dirs, prompt_ids, reference):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"verify_budget": 20}))  # what `starjar profile` records
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    target = None
    try:
        target = ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address,
                               "--port", "0", "--batch-size", "4", "--tree", "adaserve", "--tree-width", "3",
                               "--profile", str(profile), "--metrics-port", "0", "--worker-id", "tree-t0")
        prompts = prompt_ids[:6]
        with Client(target.address, timeout=120) as c:
            outs = [c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in prompts]
        assert [o.token_ids for o in outs] == [r[:MAX_TOKENS] for r in reference("llama")[:6]]
        m = _scrape(target.ready["metrics"])
        assert m["starjar_target_tree_verify_budget"] == 20  # the profile's budget, not a constant
        assert m["starjar_target_tree_rounds_total"] > 0  # trees were verified, not chains
        assert m["starjar_target_tree_nodes_total"] > m["starjar_target_tree_rounds_total"]
        assert m["starjar_target_spec_decode_num_accepted_tokens_total"] > 0
    finally:
        for p in (target, draft):
            if p is not None:
                p.kill()


@pytest.mark.parametrize("argv, needle", [
    (["--tree", "bushy"], "argument --tree: invalid choice: 'bushy' (choose from 'adaserve', 'global_greedy'"),
    (["--tree", "adaserve", "--tree-width", "0"], "invalid --tree-width: must be in [1, 16]"),
    (["--tree", "fixed", "--tree-budget", "0"], "invalid --tree-budget: must be in [1, 4096]"),
    (["--tree", "none", "--gamma", "3"], "invalid --tree: none (no speculation) cannot go with --gamma > 0"),
])
def test_a_bad_tree_flag_is_named_with_its_allowed_values(capsys, argv, needle):
    from controller.cli.main import main

    if argv[1] == "bushy":  # argparse's own choices check
        with pytest.raises(SystemExit):
            main(["serve", "target", *argv])
    else:
        assert main(["serve", "target", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_up_spec_checks_tree_flags_and_takes_the_profiled_budget(tmp_path, model_dirs):
    from controller.cli.up import _tree_fields

    with pytest.raises(InvalidArgument, match="--tree"):
        ClusterSpec(model_dirs["llama"], model_dirs["draft"], tree="bushy").validate()
    with pytest.raises(InvalidArgument, match="--tree-cap"):
        ClusterSpec(model_dirs["llama"], model_dirs["draft"], tree="adaserve", tree_cap=0).validate()
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"verify_budget": 12}))

    class Args:
        tree, tree_width, tree_cap, tree_budget = "global_greedy", 2, 8, None

    Args.profile = str(profile)
    fields = _tree_fields(Args)
    assert fields == {"tree": "global_greedy", "tree_width": 2, "tree_cap": 8, "tree_budget": 12}
    spec = ClusterSpec(model_dirs["llama"], model_dirs["draft"], **fields).validate()
    assert ClusterSpec.from_dict(spec.to_dict()).tree_budget == 12  # what every target actor is given


def test_budget_sources_explicit_then_profile_then_measured(tmp_path, models):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"verify_budget": 9}))
    assert tree_config("adaserve", 3, 16, 5, str(profile))[0].budget == 5
    cfg, note = tree_config("adaserve", 3, 16, None, str(profile))
    assert cfg.budget == 9 and "verify_budget" in note
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"d0_s": 0.01}))  # a profile from before verify_budget
    assert profiled_budget(str(old)) is None
    cfg, note = tree_config("equal_greedy", 3, 16, None, str(old), models["llama"])
    assert cfg.budget >= 1 and "measured" in note
    assert tree_config("chain", 3, 16, None, None)[0] is None and tree_config("none", 3, 16, None, None)[0] is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"verify_budget": 0}))
    with pytest.raises(InvalidArgument, match="profile"):
        profiled_budget(str(bad))
    m = measure_verify_budget(models["llama"], list(range(3, 40)), ns=(1, 2, 4), repeats=2)
    assert m["budget"] in (1, 2, 4) and set(m["pass_s"]) == {"1", "2", "4"}


def test_tree_switch_sets_gamma_and_policy():
    assert tree_speculation("none", None, None) == (0, "fixed")
    assert tree_speculation("adaserve", None, None) == (TREE_MAX_DEPTH, "fixed")
    assert tree_speculation("adaserve", 5, None) == (5, None)
    assert tree_speculation("chain", None, "nightjar") == (None, "nightjar")
    assert tree_speculation(None, 3, None) == (3, None)


def test_up_parses_the_tree_flags():
    from controller.cli.main import _parser
    from controller.cli.up import _tree_fields

    args = _parser().parse_args(["up", "--tree", "fixed", "--tree-width", "2", "--tree-budget", "12"])
    assert _tree_fields(args) == {"tree": "fixed", "tree_width": 2, "tree_cap": 16, "tree_budget": 12}
    args = _parser().parse_args(["up"])
    assert _tree_fields(args)["tree"] is None and _tree_fields(args)["tree_budget"] is None
