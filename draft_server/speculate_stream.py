"""One target's Speculate stream: a reader that queues its rounds, a writer that sends their replies.

The reader task takes the target's rounds, turns each into work for the one
global queue and stops reading while max_rounds_in_flight of them are in
flight (HTTP/2 flow control then holds the target back). The compute thread
hands each reply to `deliver`, which passes it to the event loop; the writer
(`replies`, the RPC's response generator) sends it. Replies go out in the
order their rounds arrived, as draft.proto promises: the compute loop
finishes a short round before a long one that came first, so the writer
holds a finished reply until the earlier ones are sent (at most
max_rounds_in_flight are ever held). Whatever ends the stream arrives on the
same queue as the replies, so it is seen in order:
- a StarjarError (a bad round, a full queue, draining, a detach, an idle
  stream): the writer raises it, and the server's interceptor maps it;
- None (the target closed its side, or the server drains): the writer ends
  once the replies still in flight are out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from draft_server.config import DraftServerConfig
from draft_server.sessions import Session
from draft_server.stats import ServerStats
from draft_server.work_queue import RoundWork, WorkQueue
from starjar.errors import NotFound, NotServing, ServerBusy
from starjar.spec.token_tree import TokenTree
from starjar.v1 import draft_pb2 as pb
from starjar.wire.keys import DRAINING, QUEUE_FULL


class StreamHost(Protocol):
    """What a stream follows of the servicer that opened it (draft_server.service.DraftService)."""

    cfg: DraftServerConfig
    queue: WorkQueue
    stats: ServerStats
    draining: bool

    def round_work(self, session: Session, request: pb.SpeculateRequest, deliver, push=None) -> RoundWork: ...

log = logging.getLogger(__name__)


class SpeculateStream:
    def __init__(self, service: StreamHost, session: Session, requests: AsyncIterator[pb.SpeculateRequest]):
        """service: the servicer whose config, queue, stats and draining flag this stream follows."""
        self.service = service
        self.session = session
        self.requests = requests
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue = asyncio.Queue()  # (number, reply) pairs, then a StarjarError or None
        self.in_flight = 0  # rounds queued whose reply the writer has not sent yet
        self.received = 0  # rounds numbered so far, in arrival order
        self.sent = 0  # the number of the next reply to send
        self.finished: dict[int, pb.SpeculateResponse] = {}  # replies waiting for an earlier round's
        self.room = asyncio.Event()  # set while fewer than max_rounds_in_flight rounds are in flight
        self.room.set()
        self.reader_done = False

    # ---- ends, from the event loop --------------------------------------------------------

    def end(self, why: str) -> None:
        """End the stream for its session: "detached" (by Release), "replaced" (its worker attached again) or
        "idle" (no round for too long)."""
        if why == "detached":
            self.out.put_nowait(NotFound("session: detached by Release", reason=why))
        elif why == "replaced":
            self.out.put_nowait(NotFound("session: replaced by a new Attach of the same worker", reason=why))
        else:
            idle_s = self.service.cfg.stream_idle_s
            self.out.put_nowait(NotServing(f"stream: no round for {idle_s:g} s", reason=why))

    def wake_to_drain(self) -> None:
        """The server drains: the writer ends once the replies in flight are out."""
        self.out.put_nowait(None)

    # ---- the reply, from the compute thread -----------------------------------------------

    def deliver(self, number: int, work: RoundWork, replies: list, wait_s: float, compute_s: float,
                batched: int) -> None:
        """number: the round's place on this stream (bound when it was queued)."""
        resp = pb.SpeculateResponse(round_id=work.round_id, timings=pb.RoundTimings(
            queue_wait_s=wait_s, compute_s=compute_s, batched_rounds=batched))
        for req, r in zip(work.requests, replies, strict=False):
            d = resp.sequences.add(seq_id=req.seq_id[1])
            if r is None:
                d.resync = True
            elif isinstance(r, TokenTree):
                d.tokens.extend(r.tokens)
                d.parents.extend(r.parents)
                d.path_probs.extend(r.path_probs)
            else:
                d.tokens.extend(r)
        self.loop.call_soon_threadsafe(self.out.put_nowait, (number, resp))

    def push(self, seq_id: int, start: int, assumed: list[int], drafts: list[int]) -> None:
        """From the compute thread: drafts staged ahead for a sequence (draft_server.lookahead), sent at once.
        A push answers no round, so it takes no place in the replies' order."""
        resp = pb.SpeculateResponse(round_id=0)
        resp.staged.add(seq_id=seq_id, start=start, assumed=assumed, drafts=drafts)
        self.loop.call_soon_threadsafe(self.out.put_nowait, (None, resp))

    # ---- reader and writer -----------------------------------------------------------------

    async def read(self) -> None:
        """Queue the target's rounds until it closes its side; what ends the stream goes to the writer."""
        try:
            closed = await self._read_rounds()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a refusal, or a failure of ours: the writer raises it to the caller
            self.out.put_nowait(exc)
            return
        if closed:
            self.reader_done = True
            self.out.put_nowait(None)

    async def _read_rounds(self) -> bool:
        """True when the target closed its side (or its stream broke); False when the session was detached
        (the detach has already told the writer)."""
        svc, cfg = self.service, self.service.cfg
        rounds = self.requests.__aiter__()
        while True:
            await self.room.wait()
            try:
                request = await rounds.__anext__()
            except StopAsyncIteration:
                return True
            except Exception as exc:  # a broken client stream ends only this stream
                log.debug("stream of %s ended: %s", self.session.worker_id, type(exc).__name__)
                return True
            if self.session.detached:
                return False
            if svc.draining:
                raise NotServing("stream: draft server is shutting down", reason=DRAINING)
            if len(svc.queue) >= cfg.max_queued_rounds:
                svc.stats.queue_full += 1
                raise ServerBusy(f"queue: {cfg.max_queued_rounds} rounds waiting", reason=QUEUE_FULL)
            work = svc.round_work(self.session, request, functools.partial(self.deliver, self.received), self.push)
            self.received += 1
            self.in_flight += 1
            if self.in_flight >= cfg.max_rounds_in_flight:
                self.room.clear()
            svc.queue.put(work)

    async def replies(self) -> AsyncIterator[pb.SpeculateResponse]:
        """The writer: the replies in their rounds' order; raises what ends the stream."""
        while True:
            item = await self.out.get()
            if isinstance(item, Exception):
                raise item
            if item is None:  # the reader finished, or the server drains: end once replies are out
                if self.in_flight == 0:
                    return
                continue
            number, resp = item
            if number is None:  # a push
                yield resp
                continue
            self.finished[number] = resp
            while self.sent in self.finished:
                resp = self.finished.pop(self.sent)
                self.sent += 1
                self.in_flight -= 1
                self.room.set()
                yield resp
            if (self.reader_done or self.service.draining) and self.in_flight == 0:
                return

