"""`ray up` end to end on this machine: sshd on loopback, deploy/ray/cluster-local.yaml, then
`ray job submit -- starjar up --address auto`, a request, `starjar down --address auto`, `ray down`.

Ray runs with token authentication, as the file sets it up: the token at ~/.ray/auth_token (made here
when missing, removed afterwards), copied to the node by file_mounts; the job API refuses a request
without it.

Slow (installs starjar into ~/starjar-env over ssh, a few minutes) and it runs `ray stop` on this
machine, so it is marked `slow` and needs root: `pytest -m slow tests/system/test_ray_up.py`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _sh(cmd: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture
def sshd():
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("needs root and apt-get to run sshd on loopback")
    assert _sh("DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
               "openssh-server openssh-client rsync").returncode == 0
    home = Path.home()
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    key = home / ".ssh" / "id_ed25519"
    if not key.exists():
        _sh(f"ssh-keygen -q -t ed25519 -N '' -f {key}")
    auth = home / ".ssh" / "authorized_keys"
    pub = (home / ".ssh" / "id_ed25519.pub").read_text()
    if pub not in (auth.read_text() if auth.exists() else ""):
        with auth.open("a") as f:
            f.write(pub)
    auth.chmod(0o600)
    Path("/run/sshd").mkdir(exist_ok=True)
    _sh("pgrep -x sshd || /usr/sbin/sshd -o ListenAddress=127.0.0.1 -o PermitRootLogin=prohibit-password")
    assert _sh("ssh -o StrictHostKeyChecking=no -o BatchMode=yes root@127.0.0.1 true", 60).returncode == 0


@pytest.fixture
def ray_token():
    """~/.ray/auth_token, where the cluster file's file_mounts takes it from: this user's if there is one."""
    token = Path.home() / ".ray" / "auth_token"
    made = not token.exists()
    if made:
        token.parent.mkdir(mode=0o700, exist_ok=True)
        with os.fdopen(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
    yield token
    if made:
        token.unlink(missing_ok=True)


def _jobs_status_without_token() -> int:
    try:
        with urllib.request.urlopen("http://127.0.0.1:8265/api/jobs/", timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_ray_up_job_submit_starjar_up_and_down(sshd, ray_token, tmp_path):
    config = yaml.safe_load((ROOT / "deploy" / "ray" / "cluster-local.yaml").read_text())
    config["auth"]["ssh_user"] = "root"
    env_line = "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0; "
    config["head_start_ray_commands"] = [c if c == "ray stop" else env_line + c
                                         for c in config["head_start_ray_commands"]]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    # `ray` is this interpreter's (the venv's), whether or not the venv is activated; `ray job submit` sends
    # the token of ~/.ray/auth_token, as a user's would.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(ray_token),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    try:
        up = _sh(f"ray up -y {path}", cwd=ROOT, env=env)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert _jobs_status_without_token() == 401
        job = _sh("ray job submit --address http://127.0.0.1:8265 -- starjar up --address auto "
                  "--grpc-port 0 --http-port 0 --json", 600, env=env)
        assert job.returncode == 0, job.stdout[-3000:]
        addrs = json.loads(next(line for line in job.stdout.splitlines() if line.startswith('{"grpc"')))
        from starjar import Client

        with Client(addrs["grpc"], timeout=120) as c:
            assert c.generate("Hello", max_tokens=4).finish_reason in ("stop", "length")
        down = _sh("ray job submit --address http://127.0.0.1:8265 -- starjar down --address auto", 300, env=env)
        assert "starjar actors stopped" in down.stdout
    finally:
        assert _sh(f"ray down -y {path}", 300, cwd=ROOT, env=env).returncode == 0
    left = _sh("pgrep -f '[r]aylet|[g]cs_server'").stdout.split()  # brackets: not our own shell
    assert not left, left
