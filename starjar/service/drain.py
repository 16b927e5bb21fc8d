"""Graceful drain for a grpc.aio server: count the RPCs in flight, refuse new ones once draining.

A server about to go (SIGTERM, `starjar down`) lets what it has accepted
finish and answers everything new at once with UNAVAILABLE "draining", which
callers (the front end's router, the SDK) take as "not started, try
elsewhere". Health and reflection are left alone: only the methods of the
guarded service are counted and refused. The gate is one interceptor given to
grpc.aio.server(); everything it does happens on that server's event loop, and
its two fields are plain values another thread may read.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import grpc

DRAINING = "draining: this server is shutting down; retry on another"


class DrainGate(grpc.aio.ServerInterceptor):
    def __init__(self, service_name: str):
        self._prefix = f"/{service_name}/"
        self.draining = False
        self.in_flight = 0  # RPCs of the guarded service accepted and not yet returned

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> int:
        """Wait until no guarded RPC is in flight, at most `timeout` seconds; the number still in flight."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        if self.draining:
            return same_kind_handler(handler, _refuse)
        behavior = handler_behavior(handler)
        if not (inspect.isasyncgenfunction(behavior) or inspect.iscoroutinefunction(behavior)):
            return handler  # a synchronous servicer runs on grpc's thread pool: not counted
        return same_kind_handler(handler, self._counted(behavior))

    def _counted(self, behavior):
        gate = self
        if inspect.isasyncgenfunction(behavior):
            async def counted_stream(request, context):
                gate.in_flight += 1
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    gate.in_flight -= 1
            return counted_stream

        async def counted(request, context):
            gate.in_flight += 1
            try:
                return await behavior(request, context)
            finally:
                gate.in_flight -= 1
        return counted


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)


def handler_behavior(handler: grpc.RpcMethodHandler):
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)


def same_kind_handler(handler: grpc.RpcMethodHandler, behavior, request_deserializer=None) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind and (de)serializers as `handler` (or `request_deserializer` when
    given), running `behavior`."""
    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kind[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)
