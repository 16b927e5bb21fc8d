"""`starjar up --tree adaserve` as a user runs it: the Ray cluster (controller, draft server, two target
actors, front end) started through the CLI, requests through the SDK with and without a TPOT SLO, every
greedy output equal to the target alone, and the targets' own metrics showing token trees were verified."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from local_cluster import up_cluster

from starjar import Client
from starjar.service.metrics import scrape

pytestmark = pytest.mark.slow
MAX_TOKENS, N = 24, 16
SLOS = (None, 100.0, 1e-6, None)  # no SLO, one that holds, one that cannot hold, no SLO


@pytest.fixture(scope="module")
def tree_cluster(model_dirs, tmp_path_factory):
    with up_cluster(tmp_path_factory, "--target", model_dirs["llama"], "--draft", model_dirs["draft"],
                    "--targets", "2", "--batch-size", "4", "--tree", "adaserve", "--tree-width", "3",
                    "--tree-budget", "24") as running:
        yield running


def _scrape(address: str, token: str) -> dict[str, float]:
    text = scrape(address, token)
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("starjar_") and "{" not in line}


def _generate(address: str, prompt: list[int], slo: float | None):
    with Client(address, timeout=300) as c:
        return c.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, tpot_slo_s=slo)


def test_up_tree_adaserve_is_lossless_with_and_without_slos_and_verifies_trees(tree_cluster, prompt_ids,
                                                                                reference):
    addrs, _controller = tree_cluster
    prompts, ref = prompt_ids[:N], [r[:MAX_TOKENS] for r in reference("llama", 64)[:N]]
    slos = [SLOS[i % len(SLOS)] for i in range(N)]
    with ThreadPoolExecutor(4) as pool:  # four at once: the targets batch them, the draft server batches both
        outs = list(pool.map(_generate, [addrs["grpc"]] * N, prompts, slos))
    assert [o.token_ids for o in outs] == ref  # lossless: the target alone's greedy output, token for token
    for o, slo in zip(outs, slos, strict=True):
        assert o.tpot_s > 0
        assert o.tpot_slo_met is {None: None, 100.0: True, 1e-6: False}[slo]
    scraped = [_scrape(m, addrs["metrics_token"]) for m in addrs["metrics"]]
    targets = [m for m in scraped if "starjar_target_tree_rounds_total" in m]
    assert len(targets) == 2
    rounds = sum(m["starjar_target_tree_rounds_total"] for m in targets)
    nodes = sum(m["starjar_target_tree_nodes_total"] for m in targets)
    assert all(m["starjar_target_tree_verify_budget"] == 24 for m in targets)  # --tree-budget reached them
    assert rounds > 0 and nodes > rounds  # branching trees were verified, not chains
    assert sum(m["starjar_target_spec_decode_num_accepted_tokens_total"] for m in targets) > 0
    print(f"up --tree adaserve: {N} requests equal to the target alone; tree rounds {rounds:.0f}, "
          f"nodes {nodes:.0f}")
