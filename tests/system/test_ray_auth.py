"""Ray's control plane of a local cluster requires the cluster's Ray token (real Ray, real processes).

`starjar up` writes a fresh Ray token, owner-only, beside spec.json; the keeper starts Ray with
RAY_AUTH_MODE=token and that file, and whoever joins the cluster reads it (local_ray_env). A process without
it, with Ray's auth off, or with another token, is refused by the GCS: it can neither call the controller
nor run a task that reads the cluster's secrets. One with the file joins, and the cluster serves as before.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys

import pytest
from cluster_cli import cli

from benchmarks.api import mixed_clients
from controller.cluster.spec import CONTROLLER, NAMESPACE, RAY_TOKEN_FILE

MAX_TOKENS = 16
JOIN_TIMEOUT_S = 120  # a refused driver gives up after ~20 s; this only keeps a hang from stalling the suite

# Joins the cluster at argv[1], calls the controller, runs a task reading argv[2] (the spec, with its tokens).
JOIN = f"""
import sys
import ray

ray.init(address=sys.argv[1], namespace={NAMESPACE!r}, log_to_driver=False)
print("JOINED", flush=True)
ctl = ray.get_actor({CONTROLLER!r}, namespace={NAMESPACE!r})
print("CALLED", sorted(ray.get(ctl.status.remote(), timeout=60)), flush=True)


@ray.remote
def read(path):
    return "cluster_token" in open(path).read()


print("READ", ray.get(read.remote(sys.argv[2]), timeout=60), flush=True)
"""


@pytest.fixture(scope="module")
def cluster(model_dirs, tmp_path_factory):
    home = tmp_path_factory.mktemp("starjar_home")
    env = dict(os.environ, STARJAR_HOME=str(home))
    up = cli("up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--targets", "1",
              "--gamma", "3", "--batch-size", "4", "--grpc-port", "0", "--http-port", "0", "--json", env=env)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        addrs = json.loads(up.stdout.strip().splitlines()[-1])
        state = json.loads((home / "run" / "cluster.json").read_text())
        yield {"addrs": addrs, "state": state, "run": home / "run"}
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cli("down", env=env, timeout=180)
    assert not (home / "run" / RAY_TOKEN_FILE).exists(), "`starjar down` leaves no Ray token behind"


def _join(cluster, tmp_path, **ray_env: str) -> tuple[int | None, str]:
    """Run JOIN in a fresh process with no Ray token but what ray_env gives it: (exit status or None when it
    had to be killed, its output)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    home = tmp_path / "home"  # no ~/.ray/auth_token of this machine's user to fall back on
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **ray_env)
    args = [sys.executable, "-c", JOIN, cluster["state"]["ray_address"], str(cluster["run"] / "spec.json")]
    try:
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=JOIN_TIMEOUT_S)
        return out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        return None, "\n".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                               for x in (exc.stdout, exc.stderr))


@pytest.mark.parametrize("how", ["token mode, no token", "auth disabled", "another token"])
def test_a_process_without_the_clusters_ray_token_is_refused(cluster, tmp_path, how):
    ray_env = {"token mode, no token": {"RAY_AUTH_MODE": "token"},
               "auth disabled": {"RAY_AUTH_MODE": "disabled"},
               "another token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}}[how]
    rc, out = _join(cluster, tmp_path, **ray_env)
    print(f"{how}: exit {rc}, last lines:\n" + "\n".join(out.strip().splitlines()[-3:]))
    assert "JOINED" not in out and "CALLED" not in out and "READ" not in out, out[-3000:]
    assert rc != 0
    # Refused for the token, not for some other reason: by the client itself (no token at all) or by the GCS.
    reason = ("no authentication token was found" if how == "token mode, no token"
              else "Authentication token is missing or incorrect")
    assert reason in out, out[-3000:]


def test_a_process_with_the_token_file_joins_and_the_cluster_serves_the_target_alone(cluster, tmp_path,
                                                                                      prompt_ids, reference):
    rc, out = _join(cluster, tmp_path, RAY_AUTH_MODE="token",
                    RAY_AUTH_TOKEN_PATH=str(cluster["run"] / RAY_TOKEN_FILE))
    assert rc == 0 and "JOINED" in out and "READ True" in out, out[-3000:]

    import ray

    from controller.cluster.spec import local_ray_env

    local_ray_env(cluster["run"])
    ray.init(address=cluster["state"]["ray_address"], namespace=NAMESPACE, log_to_driver=False)
    try:
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        assert ray.get(controller.status.remote(), timeout=60)["actors"]
        prompts = prompt_ids[:8]
        results = mixed_clients(cluster["addrs"]["grpc"], prompts, MAX_TOKENS)
        assert [r.token_ids for r in results] == [r[:MAX_TOKENS] for r in reference("llama", 64)[:8]]
        stats = ray.get(controller.target_stats.remote())
        assert sum(s["drafted_tokens"] for s in stats.values()) > 0, "speculation ran through the draft server"
    finally:
        ray.shutdown()


def test_the_state_spec_and_token_files_are_owner_only_and_the_token_on_no_command_line(cluster):
    run = cluster["run"]
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    modes = {name: stat.S_IMODE(os.stat(run / name).st_mode) for name in ("cluster.json", "spec.json",
                                                                           RAY_TOKEN_FILE)}
    assert modes == {"cluster.json": 0o600, "spec.json": 0o600, RAY_TOKEN_FILE: 0o600}, modes
    token = (run / RAY_TOKEN_FILE).read_text().strip()
    assert len(token) >= 32
    assert token not in (run / "cluster.json").read_text()
    import psutil

    # Ray's processes get the token's path, never the token: anyone may read a command line.
    seen = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"]]
    assert seen and not [c for c in seen if token in " ".join(c)]


def test_a_driver_for_an_address_turns_rays_token_auth_on_when_it_has_a_token(monkeypatch, tmp_path):
    """`starjar up|down --address` with a Ray token at hand and RAY_AUTH_MODE unset: Ray would send no token."""
    from controller.cluster import remote as remote_cluster
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    remote_cluster._ray_auth_if_token()
    assert "RAY_AUTH_MODE" not in os.environ  # no token anywhere: Ray's own default
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    remote_cluster._ray_auth_if_token()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    remote_cluster._ray_auth_if_token()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # an explicit choice stands
