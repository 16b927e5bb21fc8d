"""The remote proposer's own event loop, and its Speculate stream on that loop.

One daemon thread per proposer runs an asyncio loop that owns the proposer's
grpc.aio channel: the attach, release and stream calls all run there. The
engine thread never blocks on gRPC: it hands a round to the stream (one
thread-safe call) and waits for the reply on a queue the loop fills. A
sync-gRPC stream needed a request-iterator thread that gRPC drained and a
reader thread, two more hand-offs per round; here the loop writes and reads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable

import grpc

from starjar.service.serving import new_event_loop
from starjar.wire.keys import refusal_reason

log = logging.getLogger(__name__)
# What a call through the loop raises when the loop is gone or the call did not finish in time.
LOOP_ERRORS = (concurrent.futures.CancelledError, TimeoutError, RuntimeError)


class WireLoop:
    """An event loop on a daemon thread. Every method is for other threads (calling `call` from the loop's own
    thread would wait on itself)."""

    def __init__(self, name: str = "draft-wire"):
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def in_background(self, call: Awaitable, what: str) -> None:
        """A call nobody waits for (a Release: the server frees the sequences with the stream or the lease anyway)."""
        self.spawn(call).add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                           or log.debug("%s failed: %s", what, f.exception()))

    def spawn(self, coro: Awaitable) -> concurrent.futures.Future:
        """Run a coroutine on the loop; its future (cancelled if the loop has stopped)."""
        if self.loop.is_closed():
            coro.close()
            fut = concurrent.futures.Future()
            fut.cancel()
            return fut
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Awaitable, timeout: float):
        """Run a coroutine on the loop and wait for its result; LOOP_ERRORS when the loop is gone or too slow."""
        fut = self.spawn(coro)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def try_call(self, coro: Awaitable, timeout: float) -> bool:
        """`call` for what may fail unnoticed (a goodbye to a server that may be gone); False if it failed."""
        try:
            self.call(coro, timeout)
        except (grpc.RpcError, *LOOP_ERRORS):
            return False
        return True

    def soon(self, fn: Callable, *args) -> None:
        """fn(*args) on the loop, without waiting (dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed: what it would have done has no one left to do it for
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop, stop it and close it."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(cancel_all(), timeout)
        except LOOP_ERRORS:
            pass
        self.soon(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def channel_options(max_message_bytes: int, max_backoff_s: float, keepalive_s: float) -> list[tuple[str, int]]:
    """A draft channel's options: message limits, quick reconnects, keepalive pings."""
    keepalive_ms = int(keepalive_s * 1000)
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Reconnect soon after a draft server restarts (gRPC's default backoff grows to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(max_backoff_s * 1000)),
            # A hung or vanished server: an unanswered ping breaks the stream instead of TCP staying open.
            ("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", keepalive_ms),
            ("grpc.http2.ping_timeout_ms", keepalive_ms),  # what newer cores time pings by
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def failure_reason(exc: grpc.RpcError) -> str:
    """Why a call failed: the server's reason (wire.keys.refusal_reason), else the status code's name."""
    return refusal_reason(exc) or (exc.code().name.lower() if hasattr(exc, "code") else "error")


async def unary(method, request, **kwargs):
    """A unary call made on the loop (grpc.aio binds a call to the loop it is created on)."""
    return await method(request, **kwargs)


class SpeculateCall:
    """One Speculate stream on a WireLoop. `send` and `finish` may be called from any thread; the replies and
    then the end (None, or the RpcError that ended it) go to the callbacks, on the loop thread."""

    def __init__(self, wire: WireLoop, on_reply: Callable,
                 on_end: Callable[[SpeculateCall, BaseException | None], None]):
        self.wire = wire
        self.on_reply = on_reply
        self.on_end = on_end
        self._call = None
        # Made here, not in open(): a close or follow between _open_stream and open() may finish() it already
        # (a queue binds to its loop at first use).
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def open(self, stub, metadata) -> None:
        """On the loop: start the call, its writer and its reader."""
        self._call = stub.Speculate(metadata=metadata)
        self._tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._read())]

    def send(self, msg) -> None:
        """Queue one round for the writer (the engine thread's only hand-off)."""
        self.wire.soon(self._outbox.put_nowait, msg)

    def finish(self) -> None:
        """Half-close: the server answers what it has and ends the stream."""
        self.wire.soon(self._outbox.put_nowait, None)

    async def _write(self) -> None:
        call, outbox = self._call, self._outbox
        try:
            while (msg := await outbox.get()) is not None:
                await call.write(msg)
            await call.done_writing()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call ended, or a write failed: end it, so the reader reports the end
            log.debug("draft stream write stopped: %s", type(exc).__name__)
            call.cancel()

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while (resp := await self._call.read()) is not grpc.aio.EOF:
                self.on_reply(resp)
        except grpc.RpcError as exc:
            error = exc
        except asyncio.CancelledError:  # cancelled: the proposer is closing, or the writer ended the call
            error = asyncio.CancelledError()
            raise
        finally:
            for t in self._tasks:
                if t is not asyncio.current_task():
                    t.cancel()
            self.on_end(self, error)
