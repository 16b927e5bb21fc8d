"""No prompt text reaches a log line or a file: a random marker in every prompt of a run is
looked for, afterwards, in every log and every file the run left; it must appear nowhere.

The prompts go through every path that handles text: unary and streaming generation, chat, a stream the client
abandons, a prompt too long for the model and one naming an unknown model (refused), and on the cluster the
OpenAI endpoints with stop strings. Two variants: `starjar serve draft|target` as plain processes with debug
logging (CI), and a whole `starjar up` cluster on Ray, whose actors log at INFO into Ray's session directory
(slow).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from cluster_cli import cli
from prompt_marker import files_with_marker, sdk_traffic

from benchmarks.launch import ServerProcess


def test_marker_in_every_prompt_reaches_no_log_and_no_file_processes(model_dirs, tmp_path):
    marker = f"mk{uuid.uuid4().hex}"
    home, logs = tmp_path / "starjar_home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    env = dict(os.environ, STARJAR_HOME=str(home))
    verbose = "controller.cli.main -v serve"  # debug logging: the most a server says
    draft = ServerProcess("draft", "--model", model_dirs["draft"], "--port", "0", module=verbose,
                          log_path=logs / "draft.log", env=env)
    target = ServerProcess("target", "--model", model_dirs["llama"], "--draft-server", draft.address, "--port", "0",
                           "--gamma", "3", "--worker-id", "marker", module=verbose, log_path=logs / "target.log",
                           env=env)
    try:
        sdk_traffic(target.address, marker)
        assert target.terminate() == 0 and draft.terminate() == 0
        stdout = target.proc.stdout.read() + draft.proc.stdout.read()
    finally:
        target.kill()
        draft.kill()
    assert (logs / "target.log").stat().st_size > 0, "the target logged nothing: the test would prove nothing"
    assert marker not in stdout
    assert files_with_marker(marker, logs, home) == []
    (logs / "control").write_text(f"planted {marker}\n")  # the search finds a marker where there is one
    assert files_with_marker(marker, logs, home) == [str(logs / "control")]


def _http(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _http_traffic(http: str, marker: str) -> None:
    prompt = f"Tell me about {marker}, please."
    chat = [{"role": "user", "content": prompt}]
    for url, body in [("completions", {"prompt": prompt, "max_tokens": 16}),
                      ("completions", {"prompt": prompt, "max_tokens": 16, "stream": True, "stop": [marker]}),
                      ("chat/completions", {"messages": chat, "max_tokens": 16}),
                      ("chat/completions", {"messages": chat, "max_tokens": 16, "stream": True})]:
        status, raw = _http(f"{http}/v1/{url}", body)
        assert status == 200, raw
    status, _ = _http(f"{http}/v1/completions", {"prompt": f"{marker} " * 400, "max_tokens": 4})
    assert status == 400


@pytest.mark.slow
def test_marker_in_every_prompt_reaches_no_log_and_no_file_cluster(model_dirs, tmp_path):
    import ray

    from controller.cluster.spec import NAMESPACE, local_ray_env

    marker = f"mk{uuid.uuid4().hex}"
    home = tmp_path / "starjar_home"
    env = dict(os.environ, STARJAR_HOME=str(home))
    up = cli("up", "--target", model_dirs["llama"], "--draft", model_dirs["draft"], "--targets", "2", "--gamma", "3",
             "--grpc-port", "0", "--http-port", "0", "--json", env=env, timeout=600)
    assert up.returncode == 0, up.stderr[-3000:]
    addrs = json.loads(up.stdout.strip().splitlines()[-1])
    state = json.loads((home / "run" / "cluster.json").read_text())
    try:
        local_ray_env(home / "run")
        session = Path(ray.init(address=state["ray_address"], namespace=NAMESPACE,
                                log_to_driver=False).address_info["session_dir"])
        ray.shutdown()
        sdk_traffic(addrs["grpc"], marker)
        _http_traffic(addrs["http"], marker)
    finally:
        down = cli("down", env=env, timeout=300)
        if ray.is_initialized():
            ray.shutdown()
    assert down.returncode == 0, down.stderr
    assert any((session / "logs").glob("worker-*")), f"no actor logs under {session}: the test would prove nothing"
    assert marker not in up.stdout + up.stderr + down.stdout + down.stderr
    assert files_with_marker(marker, home, session) == []
