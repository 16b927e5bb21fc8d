"""The Speculate stream of a target's draft client, driven from an asyncio loop of its own.

Why a loop: the synchronous gRPC stream needs a thread to pull the request
iterator and another to read replies, and each reply crossed three Python
threads (gRPC's channel poller, the reader, the engine). Here the loop writes
each round as soon as the engine hands it over and hands each reply straight
to the engine thread's queue: one wake-up each way.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Awaitable, Callable

import grpc

from starjar.security import Security
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CLOSED = object()  # put on the reply queue when a stream ends


async def _awaited(make: Callable[[], Awaitable]):
    return await make()


class StreamLoop:
    """One asyncio loop on a daemon thread; the channels and streams of one draft client live on it."""

    def __init__(self, name: str = "draft-stream"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable], timeout: float = 10.0):
        """From another thread: await make() on the loop and wait for its result. `make` builds the awaitable
        on the loop itself, because a gRPC call binds to the loop it starts on."""
        return asyncio.run_coroutine_threadsafe(_awaited(make), self.loop).result(timeout)

    def submit(self, make: Callable[[], Awaitable], what: str) -> None:
        """Like call, without waiting (a failure is only logged)."""
        fut = asyncio.run_coroutine_threadsafe(_awaited(make), self.loop)
        fut.add_done_callback(lambda f: f.exception() and log.debug("%s failed: %s", what, f.exception()))

    def channel(self, security: Security, address: str, options: list) -> grpc.aio.Channel:
        async def make():
            return security.channel(address, options=options, aio=True)

        return self.call(make)

    def close_channel(self, channel: grpc.aio.Channel) -> None:
        if not self.loop.is_running():
            return
        try:
            self.call(channel.close, timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - closing is best effort: the process may be on its way out
            log.debug("closing the draft stream channel: %s", exc)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class DraftStream:
    """One open Speculate stream: `send` from any thread, replies put on `replies` in arrival order, then
    CLOSED once when the stream ends (by the server, a broken connection or `close`)."""

    def __init__(self, runner: StreamLoop, stub: pb_grpc.DraftServiceStub, metadata: tuple,
                 replies: queue.Queue, on_end: Callable[[DraftStream], None]):
        self._runner, self.replies, self._on_end = runner, replies, on_end
        self._closing = False

        async def open_call():
            call = stub.Speculate(metadata=metadata)
            self._outbox: asyncio.Queue = asyncio.Queue()
            self._tasks = [asyncio.ensure_future(self._write(call)), asyncio.ensure_future(self._read(call))]
            return call

        self._call = runner.call(open_call)

    def send(self, msg: pb.SpeculateRequest) -> None:
        self._runner.loop.call_soon_threadsafe(self._outbox.put_nowait, msg)

    def close(self) -> None:
        """End the stream from our side (the server sees the half-close and frees this tag's rounds)."""
        self._closing = True
        self._runner.loop.call_soon_threadsafe(self._outbox.put_nowait, CLOSED)

    async def _write(self, call) -> None:
        try:
            while (msg := await self._outbox.get()) is not CLOSED:
                await call.write(msg)
            await call.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:  # the reader sees the end and reports it
            log.debug("draft stream write ended: %s", exc)

    async def _read(self, call) -> None:
        try:
            async for resp in call:
                self.replies.put(resp)
            log.info("draft stream ended by the server")
        except grpc.RpcError as exc:
            if not self._closing:
                log.info("draft stream broken: %s", exc.code().name)
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks[0].cancel()
            self._on_end(self)  # detached first, so the engine's next step does not send to this stream
            self.replies.put(CLOSED)
