"""What every result file records about where it came from: the commit it measured and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_state(checkout: Path = ROOT) -> dict:
    """The commit measured and whether the tree had changes beside it (then the figure is not that commit's)."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def result_meta(**extra) -> dict:
    """The commit, the machine (CPU model and torch's capability first) and the date; extra fields after."""
    import torch

    from starjar.cpu.machine import machine_info

    return {**git_state(), **machine_info(), "machine": platform.machine(), "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1m": round(os.getloadavg()[0], 2), **extra}
