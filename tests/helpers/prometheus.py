"""A real Prometheus for the observability tests: promtool and prometheus, installed when missing."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def ensure_prometheus() -> None:
    """promtool and prometheus come from Debian's `prometheus` package; install it when missing."""
    if shutil.which("promtool") and shutil.which("prometheus"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail("promtool/prometheus missing: install Debian's `prometheus` package")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
