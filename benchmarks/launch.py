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


def start_draft_servers(draft_dir: str, modes: tuple[str, ...], threads: int, pin: bool,
                        device: str = "cpu") -> dict[str, ServerProcess]:
    """One `starjar serve draft` per lookahead mode. pin: the servers on the last core and this process (the
    target, one torch thread) on the others: the draft on cores of its own, as on a machine with a draft device."""
    cores = sorted(os.sched_getaffinity(0))
    if pin:
        if len(cores) < 2:
            raise SystemExit("--pin needs two cores")
        import torch

        torch.set_num_threads(1)
        os.sched_setaffinity(0, cores[-1:])  # the servers are started with this affinity and keep it
    servers: dict[str, ServerProcess] = {}
    try:
        for m in modes:
            servers[m] = ServerProcess("draft", "--model", draft_dir, "--port", "0", "--lookahead", m,
                                       "--device", device, threads=threads)
        return servers
    except BaseException:  # one failed to start: stop those already running rather than leave them behind
        for server in servers.values():
            server.terminate()
        raise
    finally:
        for tid in os.listdir("/proc/self/task") if pin else ():  # every thread of this process: the target's
            try:
                os.sched_setaffinity(int(tid), cores[:-1])
            except ProcessLookupError:  # a thread that ended since the listing
                pass
        os.sched_setaffinity(0, cores[:-1] if pin else cores)
