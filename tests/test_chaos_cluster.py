"""Issue 15, item 12 (kills): the draft server SIGKILLed 5 times while 4 targets serve 50 requests each on a
local `starjar up` cluster: nothing lost, nothing altered, every target reattached within 5 s of each restart."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_ray_cluster import _cli

from starjar import Client

pytestmark = pytest.mark.chaos
MAX_TOKENS = 24
TARGETS, PER_TARGET, KILLS = 4, 50, 5


@pytest.fixture(scope="module")
def cluster4(model_dirs, tmp_path_factory):
    home = tmp_path_factory.mktemp("starjar_home")
    env = dict(os.environ, STARJAR_HOME=str(home))
    up = _cli("up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--targets", str(TARGETS),
              "--gamma", "3", "--batch-size", "4", "--grpc-port", "0", "--http-port", "0", "--json", env=env)
    assert up.returncode == 0, up.stderr[-3000:]
    addrs = json.loads(up.stdout.strip().splitlines()[-1])
    state = json.loads((home / "run" / "cluster.json").read_text())
    import ray

    from controller.cluster_spec import CONTROLLER, NAMESPACE, local_ray_env

    local_ray_env()
    ray.init(address=state["ray_address"], namespace=NAMESPACE, log_to_driver=False)
    yield addrs, ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    ray.shutdown()
    _cli("down", env=env, timeout=180)


def _status(controller) -> dict:
    import ray

    return ray.get(controller.status.remote())


def test_draft_server_killed_five_times_loses_nothing(cluster4, spec_prompts, reference):
    addrs, controller = cluster4
    n = TARGETS * PER_TARGET
    prompts = (spec_prompts * (n // len(spec_prompts) + 1))[:n]
    ref = [r[:MAX_TOKENS] for r in reference("llama", 64)]
    ref = (ref * (n // len(ref) + 1))[:n]
    results, errors = [None] * n, []
    done = threading.Event()

    def lane(idx):
        try:
            with Client(addrs["grpc"], timeout=600) as c:
                for i in idx:
                    results[i] = c.generate(prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS).token_ids
        except Exception as exc:  # noqa: BLE001 - any failure is the test's failure
            errors.append(exc)

    reattach_s = []
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(lane, list(range(k, n, 8))) for k in range(8)]
        for _ in range(KILLS):
            time.sleep(2.0)  # requests in flight
            old = _status(controller)["actors"]["starjar-draft"]["pid"]
            os.kill(old, signal.SIGKILL)
            t_live = None
            t0 = time.time()
            while time.time() - t0 < 120:
                st = _status(controller)["actors"]
                draft = st["starjar-draft"]
                if t_live is None and draft["live"] and draft["pid"] != old:
                    t_live = time.time()
                targets = [a for name, a in st.items() if name.startswith("starjar-target")]
                if t_live is not None and all(a.get("draft_attached") for a in targets):
                    reattach_s.append(time.time() - t_live)
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"not reattached: {_status(controller)}")
        [f.result() for f in futs]
        done.set()
    lost = sum(r is None for r in results)
    altered = sum(r is not None and r != e for r, e in zip(results, ref, strict=True))
    reattach = [round(x, 2) for x in reattach_s]
    print(f"{n} requests, {KILLS} kills: lost {lost}, altered {altered}, reattach s {reattach}")
    assert not errors and lost == 0 and altered == 0
    assert len(reattach_s) == KILLS and max(reattach_s) <= 5.0
