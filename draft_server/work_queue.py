"""The one global queue between the communication half and the compute half.

Stream readers put work; the compute loop takes it. The two modes differ only
in how much one take returns: `batched` drains every pending round (up to a
cap) so one draft pass serves all targets; `fifo` returns one round, as in
StarSD. Releases ride the same queue so they are ordered with the rounds.
(How rounds are then scheduled onto forward passes is the compute loop's.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from starjar.spec.proposer import DraftRequest


@dataclass
class RoundWork:
    tag: bytes
    worker_id: str
    round_id: int
    requests: list[DraftRequest]  # seq_id = (tag, wire seq id)
    reply: Callable[[RoundWork, list, float, float, int], None]  # (work, replies, wait_s, compute_s, n)
    enqueued_s: float = field(default_factory=time.perf_counter)
    train: bool = True  # False: the target opted out of online adaptation (its tokens are never buffered)
    # Sends drafts staged ahead on the round's stream: (wire seq id, start, assumed tokens, drafts); None: nowhere
    push: Callable[[int, int, list, list], None] | None = None


@dataclass
class ReleaseWork:
    keys: list[tuple[bytes, int]]
    done: Callable[[int], None] | None = None


Work = RoundWork | ReleaseWork


class WorkQueue(Protocol):
    def put(self, item: Work) -> None: ...

    def take(self, block: bool = True, max_rounds: int | None = None) -> list[Work] | None: ...
    # up to max_rounds rounds (and the releases before the next one); blocks while empty if `block`,
    # else returns []; None once closed and drained (blocking only)

    @property
    def last_wait_s(self) -> float: ...  # how long the last take() was blocked on an empty queue

    def close(self) -> None: ...

    def __len__(self) -> int: ...


class _DequeQueue:
    def __init__(self, max_rounds: int):
        self._items: deque[Work] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._max_rounds = max_rounds
        self.last_wait_s = 0.0

    def put(self, item: Work) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def take(self, block: bool = True, max_rounds: int | None = None) -> list[Work] | None:
        cap = self._max_rounds if max_rounds is None else min(max_rounds, self._max_rounds)
        with self._cv:
            waited_from = time.perf_counter() if block and not self._items else None
            while block and not self._items and not self._closed:
                self._cv.wait()
            self.last_wait_s = time.perf_counter() - waited_from if waited_from is not None else 0.0
            if not self._items:
                return None if block else []
            out: list[Work] = []
            rounds = 0
            while self._items:
                if isinstance(self._items[0], RoundWork):
                    if rounds >= cap:
                        break
                    rounds += 1
                out.append(self._items.popleft())
            return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def __len__(self) -> int:
        return sum(isinstance(i, RoundWork) for i in list(self._items))


def make_queue(mode: str, max_batch_rounds: int) -> WorkQueue:
    return _DequeQueue(max_batch_rounds if mode == "batched" else 1)
