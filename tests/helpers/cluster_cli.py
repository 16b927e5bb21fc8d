"""The `starjar` CLI run as a user runs it, in a subprocess, for the tests that start and stop clusters."""

from __future__ import annotations

import subprocess
import sys


def cli(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """`starjar *args` with `env` (its STARJAR_HOME names the cluster); output captured as text."""
    return subprocess.run([sys.executable, "-m", "controller.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
