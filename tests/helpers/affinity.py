"""Undoing what `--pin` does to the test process (benchmarks.launch.start_draft_servers)."""

from __future__ import annotations

import os


def restore_cores(cores: set[int]) -> None:
    """Every thread of this process back on `cores` (`--pin` narrows them all to one core)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended since the listing
            pass
