"""The engine's own thread: requests in, per-step outputs out.

The target engine is single-threaded by design; gRPC handlers talk to it only
through this runner's inbox (submit, cancel) and receive each step's new
tokens through the callback they registered.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from starjar.cpu.kernels import adopt_thread_count
from starjar.spec.sampling import SamplingParams
from target_worker.engine import StepOutput, TargetEngine
from target_worker.request import Request, Status

log = logging.getLogger(__name__)

OnOutput = Callable[[StepOutput], None]
MAX_FAILED_STEPS = 3  # in a row: past this the engine is taken for broken and the worker goes NOT_SERVING
# The error of requests a dead engine never ran (queued, or submitted after): safe to retry on another worker.
ENGINE_STOPPED = "engine stopped"


class EngineRunner(threading.Thread):
    def __init__(self, engine: TargetEngine, metrics=None, on_dead: Callable[[], None] | None = None):
        """metrics: TargetMetrics, when exported. on_dead: called (from this thread) when the engine cannot go
        on; the server turns NOT_SERVING (and exits)."""
        super().__init__(name="target-engine", daemon=True)
        self.engine = engine
        self._inbox: deque = deque()
        self._cv = threading.Condition()
        self._listeners: dict[int, OnOutput] = {}
        self._stop = False
        self.metrics = metrics
        self.failed_steps = 0  # in a row
        self.dead = threading.Event()  # set when the engine cannot go on (the server turns NOT_SERVING, exits)
        self.on_dead = on_dead

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str, on_output: OnOutput,
               tpot_slo_s: float | None = None, max_draft_tokens: int | None = None) -> Request:
        """prompt_ids, params and max_draft_tokens must have been checked where the request entered (they are
        not checked again). On a dead engine the request ends at once with an error output."""
        req = Request(prompt_ids=list(prompt_ids), params=params, request_id=request_id, tpot_slo_s=tpot_slo_s,
                      max_draft_tokens=max_draft_tokens)
        with self._cv:  # under the lock: _die either sees this request in the inbox or we see it dead
            if not self.dead.is_set():
                self._inbox.append(("add", req, on_output))
                self._cv.notify()
                return req
        req.finish_reason, req.status = "error", Status.FINISHED
        on_output(StepOutput(req, [], finished=True, error=ENGINE_STOPPED))
        return req

    def cancel(self, req: Request) -> None:
        with self._cv:
            self._inbox.append(("cancel", req, None))
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    @property
    def load(self) -> int:
        """Requests running or waiting: the router's least-loaded measure."""
        return self.engine.num_running + self.engine.num_waiting + len(self._inbox)

    def _die(self, last: list[StepOutput]) -> None:
        """Steps keep failing: fail everything left, and let the server turn NOT_SERVING and exit."""
        log.error("the engine failed %d steps in a row: giving up", self.failed_steps)
        with self._cv:
            self._stop = True
            self.dead.set()
            unread = [(req, cb) for op, req, cb in self._inbox if op == "add"]  # submitted during the last step
            self._inbox.clear()
        outs = last + self.engine.fail_running(ENGINE_STOPPED)
        for req in list(self.engine.scheduler.waiting):
            self.engine.abort(req)
            req.finish_reason = "error"
            outs.append(StepOutput(req, [], finished=True, error=ENGINE_STOPPED))
        for req, cb in unread:
            self._listeners[id(req)] = cb
            req.finish_reason, req.status = "error", Status.FINISHED
            outs.append(StepOutput(req, [], finished=True, error=ENGINE_STOPPED))
        self._deliver(outs)
        if self.on_dead is not None:
            self.on_dead()

    def _deliver(self, outs: list[StepOutput]) -> None:
        for out in outs:
            cb = self._listeners.get(id(out.request))
            if cb is not None:
                cb(out)
            if out.finished:
                self._listeners.pop(id(out.request), None)

    def run(self) -> None:
        adopt_thread_count()  # this thread computes: torch's thread count, not the environment's
        while True:
            with self._cv:
                while not self._inbox and not self.engine.has_work() and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                items = list(self._inbox)
                self._inbox.clear()
            for op, req, cb in items:
                if op == "add":
                    self._listeners[id(req)] = cb
                    self.engine.enqueue(req, checked=True)
                elif not req.finished:
                    self.engine.abort(req)
                    self._listeners.pop(id(req), None)
                    if self.metrics is not None:
                        self.metrics.on_abort(req)
            if not self.engine.has_work():
                continue
            try:
                outs = self.engine.step()
                self.failed_steps = 0
            except Exception as exc:  # fail this step's requests, not the worker
                self.failed_steps += 1
                log.exception("engine step failed (%d in a row); failing its requests", self.failed_steps)
                outs = self.engine.fail_running(f"engine step failed: {type(exc).__name__}")
                if self.failed_steps >= MAX_FAILED_STEPS:
                    self._die(outs)
                    return
            if self.metrics is not None:
                self.metrics.on_outputs(outs)
            self._deliver(outs)
