"""The front end's view of the target workers: one gRPC channel each, and least-loaded routing.

Load is what this front end has in flight on each worker (it is the only
router, so that count is exact and costs nothing to read); ties go round-robin.
A request whose worker fails before sending anything is tried on another one:
nothing was streamed yet, so nothing is lost or duplicated.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Codes that mean "this worker could not take it", not "the request is wrong".
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN}


class NoTargets(RuntimeError):
    """No target worker is known or reachable."""


@dataclass
class _Target:
    name: str
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.GenerateServiceStub
    in_flight: int = 0


class TargetRouter:
    """Create and use it on one event loop (grpc.aio channels belong to their loop)."""

    def __init__(self, max_attempts: int = 3):
        self._targets: dict[str, _Target] = {}
        self._rr = itertools.count()
        self.max_attempts = max_attempts

    def update(self, addresses: dict[str, str]) -> None:
        """Set the workers (name -> HOST:PORT); a moved worker gets a fresh channel."""
        for name in list(self._targets):
            t = self._targets[name]
            if addresses.get(name) != t.address:
                del self._targets[name]
                # Streams in flight keep the old channel alive until they end; then it is collected.
                log.info("target %s left (%s)", name, t.address)
        for name, address in addresses.items():
            if name not in self._targets:
                ch = grpc.aio.insecure_channel(address)
                self._targets[name] = _Target(name, address, ch, pb_grpc.GenerateServiceStub(ch))
                log.info("target %s at %s", name, address)

    @property
    def targets(self) -> dict[str, str]:
        return {n: t.address for n, t in self._targets.items()}

    def in_flight(self) -> dict[str, int]:
        return {n: t.in_flight for n, t in self._targets.items()}

    def _pick(self, exclude: set[str]) -> _Target:
        candidates = [t for t in self._targets.values() if t.name not in exclude]
        if not candidates:
            raise NoTargets("no target worker is available")
        low = min(t.in_flight for t in candidates)
        least = [t for t in candidates if t.in_flight == low]
        return least[next(self._rr) % len(least)]

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request from the least-loaded worker. Closing the iterator cancels the upstream
        call, which frees the worker's sequence and its draft session."""
        tried: set[str] = set()
        while True:
            target = self._pick(tried)
            tried.add(target.name)
            target.in_flight += 1
            call = target.stub.Generate(request, timeout=timeout)
            sent = False
            try:
                async for resp in call:
                    sent = True
                    yield resp
                return
            except grpc.aio.AioRpcError as exc:
                if sent or exc.code() not in _RETRYABLE or len(tried) >= self.max_attempts:
                    raise
                log.warning("target %s failed before answering (%s); trying another", target.name,
                            exc.code().name)
            finally:
                target.in_flight -= 1
                call.cancel()

    async def close(self) -> None:
        for t in self._targets.values():
            await t.channel.close()
        self._targets.clear()
