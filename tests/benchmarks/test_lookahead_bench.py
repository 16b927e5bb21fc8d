"""bench lookahead's server start-up: a draft server that fails to start leaves none running."""

import os

import pytest

from benchmarks import lookahead


class _Server:
    """Stands in for a draft server process; the second one fails to start (fault injection)."""

    started: list["_Server"] = []

    def __init__(self, *args, threads: int = 1):
        if len(_Server.started) == 1:
            raise RuntimeError("draft server exited before it was ready")
        self.terminated = False
        _Server.started.append(self)

    def terminate(self) -> int:
        self.terminated = True
        return 0


@pytest.mark.parametrize("pin", [False, True])
def test_a_failed_start_stops_the_servers_already_running(monkeypatch, pin):
    if pin and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin needs two cores")
    cores = os.sched_getaffinity(0)
    _Server.started = []
    monkeypatch.setattr(lookahead, "ServerProcess", _Server)
    monkeypatch.setattr(lookahead.torch, "set_num_threads", lambda n: None)
    try:
        with pytest.raises(RuntimeError, match="before it was ready"):
            lookahead._start_servers("unused", 1, pin)
    finally:  # --pin narrows every thread of this process: give them all their cores back
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:
                pass
    assert len(_Server.started) == 1 and _Server.started[0].terminated
