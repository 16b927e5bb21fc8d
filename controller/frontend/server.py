"""The cluster's front door: the gRPC GenerateService and the OpenAI HTTP endpoint on one event loop.

It runs on its own thread (uvloop when installed), so the Ray actor that owns
it stays free to answer the controller; `set_targets` is the only way in.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
from aiohttp import web

from controller.frontend.grpc_service import BAD_TOKEN, FrontendGenerateService
from controller.frontend.limits import (
    DEFAULT_HTTP_LIMITS,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_REQUEST_TIMEOUT_S,
    HttpLimits,
    check_max_requests,
    check_request_timeout,
)
from controller.frontend.openai_http import OpenAIServer
from controller.frontend.router import TargetRouter
from starjar.service.security import Security, TokenCheck
from starjar.service.serving import HealthAndReflection, new_event_loop
from starjar.service.status import ErrorStatus
from starjar.v1 import generate_pb2, generate_pb2_grpc
from starjar.wire.keys import FRONT_END_FULL, QUEUE_FULL

log = logging.getLogger(__name__)
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


class FrontEnd:
    def __init__(self, model_name: str, tokenizer, host: str = "127.0.0.1", grpc_port: int = 0,
                 http_port: int = 0, auth_token: str | None = None, max_requests: int = DEFAULT_MAX_REQUESTS,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, upstream: Security | None = None,
                 http_limits: HttpLimits = DEFAULT_HTTP_LIMITS):
        """upstream: the cluster token and TLS of the calls to the target workers (auth_token is the users').
        max_requests: relays in flight at once before new requests are refused (429 / RESOURCE_EXHAUSTED);
        request_timeout_s: the longest a request may take, queueing included (then 504 / DEADLINE_EXCEEDED);
        http_limits: the HTTP port's header and body timeouts and body size limit."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.host = host
        self.auth_token = auth_token
        self.upstream = upstream
        self.max_requests = check_max_requests(max_requests)
        self.request_timeout_s = check_request_timeout(request_timeout_s)
        self.http_limits = http_limits
        self._ports = (grpc_port, http_port)
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="frontend-loop", daemon=True)
        self.router: TargetRouter | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._health: HealthAndReflection | None = None
        from starjar.service.metrics import new_registry

        self.registry = new_registry("front_end", target_model=model_name)
        self.registry.register(_RouterCollector(self))

    def start(self, timeout: float = 30.0) -> FrontEnd:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)
        return self

    async def _start(self) -> None:
        self.router = TargetRouter(max_requests=self.max_requests, security=self.upstream)
        # The token is checked before the request is parsed: a caller without it learns nothing, not even
        # whether its bytes were a valid request (the servicer checks it again, for use on its own).
        token_check = [TokenCheck(self.auth_token, BAD_TOKEN)] if self.auth_token else []
        self._grpc = grpc.aio.server(interceptors=[*token_check, ErrorStatus()])
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(
            FrontendGenerateService(self.router, self.model_name, self.auth_token, self.request_timeout_s),
            self._grpc)
        self._health = HealthAndReflection(self._grpc, SERVICE_NAME)
        self.grpc_port = self._grpc.add_insecure_port(f"{self.host}:{self._ports[0]}")
        if not self.grpc_port:
            raise OSError(f"cannot listen on {self.host}:{self._ports[0]} (gRPC)")
        await self._grpc.start()
        app = OpenAIServer(self.router, self.model_name, self.tokenizer, self.auth_token,
                           request_timeout_s=self.request_timeout_s, limits=self.http_limits).app()
        # No access logs: they would carry client addresses. handler_cancellation: a client that disconnects
        # cancels its handler, and so its relays, even when nothing is being written to it (non-streaming).
        # aiohttp's keep-alive timer runs from the connection (or the last response) until a request's headers
        # are whole, and data arriving does not reset it: it is the header timeout.
        limits = self.http_limits
        self._http = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                   keepalive_timeout=limits.header_timeout_s, lingering_time=limits.linger_s)
        await self._http.setup()
        site = web.TCPSite(self._http, self.host, self._ports[1])
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]
        log.info("front end: gRPC %s:%d, HTTP %s:%d", self.host, self.grpc_port, self.host, self.http_port)

    def set_targets(self, addresses: dict[str, str]) -> None:
        async def update():
            self.router.update(addresses)
            await self._health.set_serving(bool(addresses))
        asyncio.run_coroutine_threadsafe(update(), self._loop).result(10)

    def in_flight(self) -> dict[str, int]:
        async def read():
            return self.router.in_flight()
        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(10)

    def stop(self, grace: float = 5.0) -> None:
        async def stop():
            await self._grpc.stop(grace)
            await self._http.cleanup()
            await self.router.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(grace + 10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


class _RouterCollector:
    """starjar_frontend_*: what the router sees, read at scrape time."""

    def __init__(self, frontend: FrontEnd):
        self.frontend = frontend

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        router = self.frontend.router
        in_flight = dict(router.in_flight()) if router is not None else {}
        g = GaugeMetricFamily("starjar_frontend_in_flight_requests", "requests relayed now, by target worker",
                              labels=["worker"])
        for name, n in sorted(in_flight.items()):
            g.add_metric([name], n)
        yield g
        yield GaugeMetricFamily("starjar_frontend_targets", "target workers routable now", value=len(in_flight))
        refused = CounterMetricFamily("starjar_frontend_requests_refused", "requests no worker started (every "
                                      "one full or down) or the front end refused itself, by reason",
                                      labels=["reason"])
        counts = router.refused if router is not None else {}
        for reason in sorted({QUEUE_FULL, FRONT_END_FULL, "unavailable"} | set(counts)):
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
