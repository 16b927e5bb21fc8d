"""The one global queue between the communication half and the compute half.

Stream readers put work; the compute loop takes it. The two modes differ only
in how much one take returns: `batched` drains every pending round (up to a
cap) so one draft pass serves all targets; `fifo` returns one round, as in
StarSD. Releases ride the same queue so they are ordered with the rounds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from starjar.proposer import DraftRequest


@dataclass
class RoundWork:
    tag: bytes
    worker_id: str
    round_id: int
    requests: list[DraftRequest]  # seq_id = (tag, wire seq id)
    reply: Callable[["RoundWork", list, float, float, int], None]  # (work, replies, wait_s, compute_s, n)
    enqueued_s: float = field(default_factory=time.perf_counter)


@dataclass
class ReleaseWork:
    keys: list[tuple[bytes, int]]
    done: Callable[[int], None] | None = None


Work = RoundWork | ReleaseWork


class WorkQueue(Protocol):
    def put(self, item: Work) -> None: ...

    def take(self) -> list[Work] | None: ...  # blocks; None once closed and drained

    def close(self) -> None: ...

    def __len__(self) -> int: ...


class _DequeQueue:
    def __init__(self, max_rounds: int):
        self._items: deque[Work] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._max_rounds = max_rounds

    def put(self, item: Work) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def take(self) -> list[Work] | None:
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait()
            if not self._items:
                return None
            out: list[Work] = []
            rounds = 0
            while self._items and rounds < self._max_rounds:
                item = self._items.popleft()
                out.append(item)
                rounds += isinstance(item, RoundWork)
            return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        return sum(isinstance(i, RoundWork) for i in list(self._items))


def make_queue(mode: str, max_batch_rounds: int) -> WorkQueue:
    return _DequeQueue(max_batch_rounds if mode == "batched" else 1)
