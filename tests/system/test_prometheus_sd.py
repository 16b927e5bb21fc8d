"""Prometheus discovery of a local cluster as the README describes it: `starjar up` with no Prometheus flag keeps
$STARJAR_HOME/run/prometheus_sd.json and metrics.token current, a real Prometheus pointed at them scrapes every
endpoint, and `starjar down` removes both (a stale pair would send Prometheus to dead ports with a dead token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest
from cluster_cli import cli
from loopback import free_port, http_get
from prometheus import ensure_prometheus


def _listed(sd: Path) -> set[str]:
    try:
        return {t for g in json.loads(sd.read_text()) for t in g["targets"]}
    except (OSError, ValueError):
        return set()


def _wait_listed(sd: Path, endpoints: set[str], timeout: float = 30.0) -> list[dict]:
    """The SD file once it lists exactly `endpoints` (the controller rewrites it within a poll of a change)."""
    deadline = time.time() + timeout
    while _listed(sd) != endpoints:
        assert time.time() < deadline, (sd.exists() and sd.read_text(), endpoints)
        time.sleep(0.25)
    return json.loads(sd.read_text())


def _prometheus_sees_every_target_up(tmp: Path, sd: Path, token_file: Path, endpoints: set[str]) -> None:
    """A real Prometheus given only the two files: every target it discovers is scraped, with the token."""
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML; the minimal config of a user following the README
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "starjar",
                            "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
                            "file_sd_configs": [{"files": [str(sd)], "refresh_interval": "1s"}]}]}))
    port = free_port()
    with open(tmp / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline, seen = time.time() + 60, {}
        while time.time() < deadline:
            try:
                active = json.loads(http_get(f"http://127.0.0.1:{port}/api/v1/targets?state=active"))["data"]
                seen = {t["labels"]["instance"]: (t["health"], t["lastError"]) for t in active["activeTargets"]}
                if set(seen) == endpoints and all(h == "up" for h, _ in seen.values()):
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        pytest.fail(f"Prometheus targets {seen} (want {sorted(endpoints)} up): "
                    + (tmp / "prometheus.log").read_text()[-2000:])
    finally:
        prom.terminate()
        prom.wait(30)


def test_up_without_flags_keeps_the_run_directory_sd_and_token_current_and_down_removes_them(model_dirs,
                                                                                             tmp_path):
    ensure_prometheus()
    run = tmp_path / "home" / "run"
    run.mkdir(parents=True)
    sd, token_file = run / "prometheus_sd.json", run / "metrics.token"
    # What an earlier cluster left behind: a port nobody listens on and that cluster's token.
    sd.write_text(json.dumps([{"targets": [f"127.0.0.1:{free_port()}"], "labels": {"component": "front_end"}}]))
    token_file.write_text("token-of-a-cluster-long-gone-0000000000\n")
    env = dict(os.environ, STARJAR_HOME=str(tmp_path / "home"))
    try:
        up = cli("up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--grpc-port", "0",
                  "--http-port", "0", "--json", env=env)
        assert up.returncode == 0, up.stderr[-3000:]
        endpoints = set(json.loads(up.stdout.strip().splitlines()[-1])["metrics"])
        groups = _wait_listed(sd, endpoints)
        assert {g["labels"]["component"] for g in groups} == {"draft_server", "target_worker", "front_end",
                                                               "controller"}
        token = token_file.read_text().strip()
        assert token == json.loads((run / "spec.json").read_text())["cluster_token"] and len(token) >= 32
        for path in (sd, token_file):  # the token, and where every endpoint that takes it listens
            assert oct(path.stat().st_mode & 0o777) == "0o600", path
        for endpoint in endpoints:
            assert b"\nstarjar_" in http_get(f"http://{endpoint}/metrics", token), endpoint
            with pytest.raises(urllib.error.HTTPError) as err:
                http_get(f"http://{endpoint}/metrics")
            assert err.value.code == 401, endpoint
        _prometheus_sees_every_target_up(tmp_path, sd, token_file, endpoints)
    finally:
        down = cli("down", env=env, timeout=180)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not sd.exists() and not token_file.exists()


def _down_after_a_cluster_with(home: Path, sd: Path, cluster_token: str) -> None:
    """`starjar down` (stop_local) after a cluster of `home` with `--prometheus-sd sd` whose keeper has ended."""
    run = home / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.json").write_text(json.dumps({"prometheus_sd": str(sd), "cluster_token": cluster_token}))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / "cluster.json").write_text(json.dumps({"keeper_pid": int(ended.stdout), "pids": [],
                                                  "drain_timeout_s": 0}))
    from controller.cluster.local import stop_local

    assert stop_local() is not None


@pytest.mark.parametrize("written_by", ["this cluster", "another cluster"])
def test_down_removes_an_explicit_sd_path_only_while_its_token_is_this_clusters(tmp_path, monkeypatch,
                                                                              written_by):
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path / "home"))
    sd = tmp_path / "targets" / "starjar.json"
    sd.parent.mkdir()
    sd.write_text("[]")
    # Another cluster (of another $STARJAR_HOME) given the same path since rewrote both files with its token.
    (sd.parent / "metrics.token").write_text(("ours" if written_by == "this cluster" else "theirs") + "\n")
    _down_after_a_cluster_with(tmp_path / "home", sd, "ours")
    assert sd.exists() == (written_by == "another cluster")
    assert (sd.parent / "metrics.token").exists() == (written_by == "another cluster")


def test_up_flags_give_the_spec_its_sd_path(model_dirs, tmp_path, monkeypatch):
    """No flag: the run directory's file for a local cluster, none on someone else's Ray cluster (--address)."""
    from controller.cli.main import _parser
    from controller.cli.up import _spec

    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    base = ["up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--gamma", "2"]
    assert _spec(_parser().parse_args(base)).prometheus_sd == str(tmp_path / "run" / "prometheus_sd.json")
    assert _spec(_parser().parse_args([*base, "--address", "auto"])).prometheus_sd is None
    for extra in ([], ["--address", "auto"]):
        given = _spec(_parser().parse_args([*base, *extra, "--prometheus-sd", "targets/starjar.json"]))
        assert given.prometheus_sd == os.path.abspath("targets/starjar.json")
