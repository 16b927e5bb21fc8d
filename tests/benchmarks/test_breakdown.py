"""`starjar bench breakdown`'s measurement of one deployment: a real `starjar serve target` process with a real
draft server on loopback (tiny models), its engine phases and draft rounds read from its /metrics
(`starjar_target_engine_seconds`), outputs equal to HF generate()."""

import subprocess
import sys

import pytest

from benchmarks import background, breakdown
from benchmarks.launch import ServerProcess

MAX_NEW = 16


def test_one_deployment_is_measured_from_the_targets_metrics(model_dirs, prompt_ids, reference, monkeypatch):
    monkeypatch.setattr(breakdown, "MAX_NEW", MAX_NEW)
    prompts = prompt_ids[:4]
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0")
    target = None
    try:
        target = ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address,
                               "--port", "0", "--gamma", "2", "--batch-size", "1", "--metrics-port", "0")
        row = breakdown.measure_deployment("processes", 2, target.address, target.ready["metrics"], prompts)
    finally:
        for p in (target, draft):
            if p is not None:
                p.kill()
    assert row["outputs"] == [r[:MAX_NEW] for r in reference("llama")[:4]]
    assert row["tokens"] == sum(map(len, row["outputs"]))
    # Only the measured requests' steps: each yields a token at least, after the prefill's first (the warm-up
    # request's 3 steps would break this when every draft is accepted).
    assert 0 < row["decode_steps"] <= row["tokens"] - len(prompts)
    phases = row["engine_s"]
    assert phases["prefill"] > 0 and phases["propose"] > 0 and phases["verify"] > 0
    assert sum(phases.values()) < row["wall_s"]  # the engine thread's phases fit inside the wall time
    rounds = row["draft_rounds"]
    assert rounds["rounds"] > 0 and rounds["compute_s"] > 0 and rounds["wire_ms_per_round"] >= 0


def test_speedups_compare_each_deployment_with_itself():
    runs = [{"deployment": d, "gamma": g, "wall_s": w} for d, g, w in
            [("co-located", 0, 10.0), ("co-located", 2, 8.0), ("processes", 0, 10.0), ("processes", 2, 9.0),
             ("ray", 0, 12.0), ("ray", 2, 12.0)]]
    assert breakdown._speedups(runs) == {"co-located": 1.25, "processes": 1.111, "ray": 1.0}
    runs.append({"deployment": breakdown.BESIDE, "gamma": 0, "wall_s": 11.0})
    assert breakdown._speedups(runs)["idle_cluster_slowdown"] == 1.1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_background_sample_sees_a_busy_neighbour_and_leaves_out_what_it_is_told():
    burn = "import time\nt = time.time()\nwhile time.time() - t < 4: pass"
    busy = subprocess.Popen([sys.executable, "-c", burn])
    try:
        seen = background.sample(1.5)
        left_out = background.sample(1.5, exclude={busy.pid})
    finally:
        busy.kill()
        busy.wait()
    assert seen["cpu_pct_of_one_core"] >= 60  # the neighbour spins on a core of its own
    assert left_out["cpu_pct_of_one_core"] < seen["cpu_pct_of_one_core"] - 40
    assert seen["wakeups_per_s"] >= 0 and seen["seconds"] >= 1.4
