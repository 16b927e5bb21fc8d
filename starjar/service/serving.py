"""What every starjar gRPC server does alike: health, reflection, uvloop and SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)


class HealthAndReflection:
    """grpc.health.v1 (overall and per service) and server reflection for one service."""

    def __init__(self, server: grpc.aio.Server, service_name: str):
        self.service_name = service_name
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", self.service_name):
            await self._health.set(name, status)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A loop for a thread of its own: uvloop when installed (its cross-thread wake-up is the cheaper one)."""
    try:
        import uvloop
    except ImportError:
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    loop.set_exception_handler(quiet_closed_peer)
    return loop


def quiet_closed_peer(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's exception handler: everything as asyncio reports it, except one case. grpc.aio's completion
    queue is shared by every loop in the process, and a late event for a loop already closed (a remote
    proposer that closed) is handed to it from whichever loop wakes: "Event loop is closed". Nothing is lost
    there (that loop's calls were done or cancelled), so it is a debug line, not a traceback."""
    exc = context.get("exception")
    if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc) and \
            "PollerCompletionQueue" in repr(context.get("handle")):
        log.debug("a gRPC event for a closed event loop was dropped")
        return
    loop.default_exception_handler(context)


def run_until_signalled(start: Callable[[], Awaitable[int]], stop: Callable[[], Awaitable[None]],
                        on_ready: Callable[[int], None] | None = None) -> None:
    """Start a server on uvloop (when installed), report its port, and stop it on SIGTERM/SIGINT."""

    async def main() -> None:
        port = await start()
        if on_ready:
            on_ready(port)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
        await stop()

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


class BackgroundLoop:
    """An event loop on its own daemon thread, for servers hosted inside another runtime (Ray actors)."""

    def __init__(self, name: str = "server-loop"):
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60.0):
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
