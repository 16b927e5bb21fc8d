"""Start starjar servers as real processes on loopback and learn their addresses (tests, benchmarks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time


class ServerProcess:
    def __init__(self, *args: str, threads: int = 1, module: str = "controller.cli.main serve", log_path=None,
                 env: dict | None = None):
        """log_path: append the server's stderr (its log) to this file instead of discarding it."""
        env = dict(env or os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error")
        self.args = args
        self.log_path = log_path
        stderr = open(log_path, "ab") if log_path else subprocess.PIPE
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", *module.split(), *args],
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        finally:
            if log_path:
                stderr.close()  # the child holds its own copy
        self.ready: dict = {}
        self.address = self._wait_ready()
        if not log_path:  # keep draining stderr so the server never blocks on a full pipe
            threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def _log_tail(self) -> str:
        if self.log_path:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-2000:]
        return self.proc.stderr.read()[-2000:]

    def _wait_ready(self, timeout: float = 120.0) -> str:
        deadline = time.time() + timeout
        result = {}

        def read():
            line = self.proc.stdout.readline()
            if line:
                result["line"] = line

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.time()))
        if "line" not in result:
            self.kill()
            raise RuntimeError(f"server {self.args} did not start: {self._log_tail()}")
        self.ready = json.loads(result["line"])
        return self.ready["address"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)
