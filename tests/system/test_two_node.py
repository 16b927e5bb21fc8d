"""Placement across nodes: a Ray cluster of two nodes on this machine, a head on 127.0.0.1 offering
starjar_target slots and a second node (`ray start --address`, its own IP 127.0.0.2) offering starjar_draft
slots, both with Ray's token authentication (a node without the token is refused). `starjar up --address
--draft-servers 2`: both draft servers on the second node, every target on the head, each publishing its
node's IP; then the failover check of test_draft_failover (one draft server SIGKILLed under 4 targets x 50
requests: nothing lost or altered, its targets on the other within 2 s).

Only the Ray processes this test started are stopped (by pid, found by its own temp dir): never `ray stop`,
which would take every Ray cluster on the machine with it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile

import pytest
from cluster_cli import cli
from fleet_load import DRAFTS, TARGETS, kill_one_draft_under_load, status

from controller.cluster.spec import RAY_TOKEN_FILE, local_ray_env

pytestmark = pytest.mark.chaos
HEAD_IP, DRAFT_IP = "127.0.0.1", "127.0.0.2"


def _ray(*args: str, env: dict) -> None:
    out = subprocess.run(["ray", *args], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HEAD_IP, 0))
        return s.getsockname()[1]


def _stop_ours(marks: tuple[str, ...]) -> None:
    """SIGKILL the processes of our Ray cluster: those whose command line names its temp dir or GCS address."""
    import psutil

    ours = [p for p in psutil.process_iter(["cmdline"])
            if any(m in " ".join(p.info["cmdline"] or []) for m in marks) and p.pid != os.getpid()]
    for p in ours:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


@pytest.fixture(scope="module")
def two_nodes(model_dirs):
    temp_dir = tempfile.mkdtemp(prefix="sj2n", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    try:
        # Every node and every driver reads the same Ray token, from a file only its owner may read.
        with os.fdopen(os.open(os.path.join(temp_dir, RAY_TOKEN_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                               0o600), "w") as f:
            f.write(secrets.token_hex(32))
        env = {**os.environ, **local_ray_env(temp_dir), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
               "STARJAR_HOME": os.path.join(temp_dir, "home")}
        _ray("start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={port}", f"--temp-dir={temp_dir}",
             "--include-dashboard=false", "--num-cpus=2", f"--resources={json.dumps({'starjar_target': TARGETS})}",
             "--object-store-memory=200000000", env=env)
        _ray("start", f"--address={HEAD_IP}:{port}", f"--node-ip-address={DRAFT_IP}", "--num-cpus=2",
             f"--temp-dir={temp_dir}",
             f"--resources={json.dumps({'starjar_draft': 2})}", "--object-store-memory=200000000", env=env)
        address = f"{HEAD_IP}:{port}"
        up = cli("up", "--address", address, "--target", model_dirs["llama"], "--draft", model_dirs["draft"],
                  "--targets", str(TARGETS), "--draft-servers", "2", "--gamma", "3", "--batch-size", "4",
                  "--grpc-port", "0", "--http-port", "0", "--json", env=env, timeout=600)
        assert up.returncode == 0, up.stderr[-3000:]
        addrs = json.loads(up.stdout.strip().splitlines()[-1])
        import ray

        from controller.cluster.spec import CONTROLLER, NAMESPACE

        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        yield addrs, ray.get_actor(CONTROLLER, namespace=NAMESPACE), {"address": address, "temp_dir": temp_dir}
        ray.shutdown()
        cli("down", "--address", address, env=env, timeout=180)
    finally:
        _stop_ours((temp_dir, f"{HEAD_IP}:{port}"))
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_drafts_on_one_node_targets_on_the_other_and_failover_across_them(two_nodes, prompt_ids, reference):
    addrs, controller, _ = two_nodes
    st = status(controller)
    places = {n: a["address"].rsplit(":", 1)[0] for n, a in st["actors"].items() if a.get("address")}
    print(f"placement: {places}")
    import ray

    nodes = {n["NodeManagerAddress"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    print(f"nodes: { {ip: sorted(k for k in r if k.startswith('starjar')) for ip, r in nodes.items()} }")
    target_ips = {ip for n, ip in places.items() if n.startswith("starjar-target")}
    assert all(places[d] == DRAFT_IP for d in DRAFTS) and "starjar_draft" in nodes[DRAFT_IP]
    # The head's IP as Ray reports it (Ray may name the host's own address rather than the loopback one).
    assert len(target_ips) == 1 and DRAFT_IP not in target_ips
    assert "starjar_target" in nodes[target_ips.pop()]
    assert [len(st["drafts"]["servers"][d]["attached"]) for d in DRAFTS] == [2, 2]
    run = kill_one_draft_under_load(addrs, controller, prompt_ids, reference)
    print(f"two nodes: {run.requests} requests, 1 of 2 draft servers killed: lost {run.lost}, "
          f"altered {run.altered}, moved in s { {t: round(s, 3) for t, s in run.took.items()} }")
    assert not run.errors and run.lost == 0 and run.altered == 0
    assert max(run.took.values()) <= 2.0 and run.speculating_after


def test_a_node_without_the_ray_token_is_refused(two_nodes):
    """`ray start --address` with Ray's auth off (so no token sent): the GCS refuses it, no node joins."""
    import ray

    _, _, where = two_nodes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE="disabled", HOME=where["temp_dir"], RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
    before = len([n for n in ray.nodes() if n["Alive"]])
    out = subprocess.run(["ray", "start", f"--address={where['address']}", "--node-ip-address=127.0.0.3",
                          "--num-cpus=1", f"--temp-dir={where['temp_dir']}", "--object-store-memory=100000000"],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "Authentication token is missing or incorrect" in out.stdout + out.stderr
    assert len([n for n in ray.nodes() if n["Alive"]]) == before
