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
    def __init__(self, *args: str, threads: int = 1, module: str = "controller.cli serve"):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", *module.split(), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.ready: dict = {}
        self.address = self._wait_ready()
        # Keep draining stderr so the server never blocks on a full pipe.
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

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
            raise RuntimeError(f"server {self.args} did not start: {self.proc.stderr.read()[-2000:]}")
        self.ready = json.loads(result["line"])
        return self.ready["address"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)
