"""The front end's view of the target workers: one gRPC channel each, and least-loaded routing.

Load is what this front end has in flight on each worker (it is the only
router, so that count is exact and costs nothing to read); ties go round-robin.
A request whose worker did not start it (`not_started`: UNAVAILABLE before
any token, i.e. down, draining or its engine stopped; RESOURCE_EXHAUSTED with
reason queue_full, its queue is full) is tried on another one: nothing was
streamed yet, so nothing is lost or duplicated. Every other failure (INTERNAL,
UNKNOWN, a RESOURCE_EXHAUSTED of gRPC's own such as a message too large) may
have run the request, or been caused by it, so it reaches the caller as it is.
Past max_requests relays at once the front end refuses new requests itself
(Overloaded).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from controller.frontend.limits import DEFAULT_MAX_REQUESTS, check_max_requests
from starjar.errors import NotServing, ServerBusy
from starjar.service.security import Security
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc
from starjar.wire.keys import FRONT_END_FULL, QUEUE_FULL, refusal_reason

log = logging.getLogger(__name__)

COOL_DOWN_S = 2.0  # a worker that refused is tried after the others for this long


def not_started(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failure before any token means "this worker did not start it" (so another may), not "the
    request is wrong" or "it failed while running"."""
    code = exc.code()
    if code is grpc.StatusCode.UNAVAILABLE:
        return True
    return code is grpc.StatusCode.RESOURCE_EXHAUSTED and refusal_reason(exc) == QUEUE_FULL


class NoTargets(NotServing):
    """No target worker is known or reachable."""


class Overloaded(ServerBusy):
    """The front end already relays its limit of requests (reason front_end_full)."""

    def __init__(self, message: str):
        super().__init__(message, FRONT_END_FULL)


@dataclass
class _Target:
    name: str
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.GenerateServiceStub
    in_flight: int = 0
    cool_until: float = 0.0  # monotonic time before which others are preferred (it refused a request)


class TargetRouter:
    """Create and use it on one event loop (grpc.aio channels belong to their loop)."""

    def __init__(self, max_attempts: int | None = None, max_requests: int = DEFAULT_MAX_REQUESTS,
                 security: Security | None = None):
        """max_attempts: workers tried per request (default: each one once). security: the cluster token
        and TLS of the calls to the workers."""
        self.security = security or Security()
        self._auth = self.security.metadata()
        check_max_requests(max_requests)
        self._targets: dict[str, _Target] = {}
        # Workers dropped from the set while relays to them run: their counts still hold a place under
        # max_requests, and a worker back at the same address gets its count back (a missed poll, not a move).
        self._leaving: dict[str, _Target] = {}
        self._rr = itertools.count()
        self.max_attempts = max_attempts
        self.max_requests = max_requests
        self.refused: Counter[str] = Counter()  # requests this front end refused or saw refused, by reason

    def update(self, addresses: dict[str, str]) -> None:
        """Set the workers (name -> HOST:PORT); a moved worker gets a fresh channel."""
        self._leaving = {n: t for n, t in self._leaving.items() if t.in_flight > 0}
        for name in list(self._targets):
            t = self._targets[name]
            if addresses.get(name) != t.address:
                del self._targets[name]
                # Streams in flight keep the old channel alive until they end; then it is collected.
                if t.in_flight > 0:
                    self._leaving[name] = t
                log.info("target %s left (%s)", name, t.address)
        for name, address in addresses.items():
            if name not in self._targets:
                back = self._leaving.pop(name, None)
                if back is not None and back.address == address:
                    self._targets[name] = back
                    continue
                if back is not None:  # moved: the old address's relays still count until they end
                    self._leaving[name] = back
                ch = self.security.channel(address, aio=True)
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
        now = time.monotonic()
        rested = [t for t in candidates if t.cool_until <= now] or candidates
        low = min(t.in_flight for t in rested)
        least = [t for t in rested if t.in_flight == low]
        return least[next(self._rr) % len(least)]

    def _may_retry(self, tried: set[str]) -> bool:
        untried = any(name not in tried for name in self._targets)
        return untried and (self.max_attempts is None or len(tried) < self.max_attempts)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one request from the least-loaded worker. Closing the iterator cancels the upstream
        call, which frees the worker's sequence and its draft session. timeout bounds the whole request,
        retries included."""
        relaying = sum(t.in_flight for t in (*self._targets.values(), *self._leaving.values()))
        if relaying >= self.max_requests:
            self.refused[FRONT_END_FULL] += 1
            raise Overloaded(f"the front end is relaying {relaying} requests, its limit (--max-requests "
                             f"{self.max_requests}); retry later")
        deadline = None if timeout is None else time.monotonic() + timeout
        tried: set[str] = set()
        full: grpc.aio.AioRpcError | None = None  # a worker's RESOURCE_EXHAUSTED: "retry later" beats "down"
        while True:
            target = self._pick(tried)
            tried.add(target.name)
            target.in_flight += 1
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = target.stub.Generate(request, timeout=left, metadata=self._auth)
            sent = False
            try:
                async for resp in call:
                    sent = True
                    yield resp
                return
            except grpc.aio.AioRpcError as exc:
                if sent or not not_started(exc):
                    raise
                target.cool_until = time.monotonic() + COOL_DOWN_S
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full = exc
                if not self._may_retry(tried):
                    self.refused[QUEUE_FULL if full else "unavailable"] += 1
                    # Every worker refused; if one was full, the caller hears "retry later".
                    raise (full or exc) from None
                log.warning("target %s did not start the request (%s); trying another", target.name,
                            exc.code().name)
            finally:
                target.in_flight -= 1
                call.cancel()

    async def close(self) -> None:
        for t in self._targets.values():
            await t.channel.close()
        self._targets.clear()
