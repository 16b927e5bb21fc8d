"""Continuous batching: who runs this step, within a batch size and a KV budget.

Admission is FCFS. A request joins when the batch has room and the KV budget
can hold its prompt plus one speculative step of headroom for every running
sequence. When running sequences outgrow the budget, the newest is preempted
(its KV dropped, to be recomputed when it is readmitted) so older ones finish.
"""

from __future__ import annotations

from collections import deque

from target_worker.request import Request, Status


class Scheduler:
    def __init__(self, max_batch_size: int, kv_budget_tokens: int, step_headroom: int):
        self.max_batch_size = max_batch_size
        self.kv_budget_tokens = kv_budget_tokens
        self.step_headroom = step_headroom  # KV tokens one speculative step may add per sequence
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, tokens_used: int) -> list[Request]:
        joined = []
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            need = req.num_tokens + self.step_headroom * (len(self.running) + 1)
            if self.running and tokens_used + need > self.kv_budget_tokens:
                break  # FCFS: later requests wait behind the head
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            joined.append(req)
            tokens_used += req.num_tokens
        return joined

    def pick_victim(self) -> Request | None:
        """The newest running request, to preempt when the KV budget runs out."""
        return self.running[-1] if len(self.running) > 1 else None

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        req.status = Status.FINISHED
