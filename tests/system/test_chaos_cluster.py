"""Kills: the draft server SIGKILLed 5 times while 4 targets serve 50 requests each on a
local `starjar up` cluster: nothing lost, nothing altered, every target reattached within 5 s of each restart."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fleet_load import lane_of, status, workload
from local_cluster import up_cluster

pytestmark = pytest.mark.chaos
TARGETS, PER_TARGET, KILLS = 4, 50, 5


@pytest.fixture(scope="module")
def cluster4(model_dirs, tmp_path_factory):
    with up_cluster(tmp_path_factory, "--target", model_dirs["llama"], "--draft", model_dirs["draft"],
                    "--targets", str(TARGETS), "--gamma", "3", "--batch-size", "4") as running:
        yield running


def test_draft_server_killed_five_times_loses_nothing(cluster4, prompt_ids, reference):
    addrs, controller = cluster4
    n = TARGETS * PER_TARGET
    prompts, ref = workload(prompt_ids, reference, n)
    results, errors = [None] * n, []
    done = threading.Event()
    lane = lane_of(addrs["grpc"], prompts, results, errors)

    reattach_s = []
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(lane, list(range(k, n, 8))) for k in range(8)]
        for _ in range(KILLS):
            time.sleep(2.0)  # requests in flight
            old = status(controller)["actors"]["starjar-draft"]["pid"]
            os.kill(old, signal.SIGKILL)
            t_live = None
            t0 = time.time()
            while time.time() - t0 < 120:
                st = status(controller)["actors"]
                draft = st["starjar-draft"]
                if t_live is None and draft["live"] and draft["pid"] != old:
                    t_live = time.time()
                targets = [a for name, a in st.items() if name.startswith("starjar-target")]
                if t_live is not None and all(a.get("draft_attached") for a in targets):
                    reattach_s.append(time.time() - t_live)
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"not reattached: {status(controller)}")
        [f.result() for f in futs]
        done.set()
    lost = sum(r is None for r in results)
    altered = sum(r is not None and r != e for r, e in zip(results, ref, strict=True))
    reattach = [round(x, 2) for x in reattach_s]
    print(f"{n} requests, {KILLS} kills: lost {lost}, altered {altered}, reattach s {reattach}")
    assert not errors and lost == 0 and altered == 0
    assert len(reattach_s) == KILLS and max(reattach_s) <= 5.0
