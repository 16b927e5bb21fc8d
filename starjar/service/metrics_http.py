"""The HTTP server of the metrics ports: every port of a process on one event loop, on one thread.

aiohttp's low-level server parses the requests. A connection costs a socket
and a coroutine, never a thread; aiohttp's keep-alive timer runs from the
connection (or the previous response) until a request's headers are whole and
is not reset by data arriving, so it closes idle and slow-header connections
alike; past the connection limit the oldest connection is dropped for the new
one, so a flood of sockets cannot lock scrapes out for longer than it keeps
opening new ones.
"""

from __future__ import annotations

import asyncio
import socket
import threading

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from starjar.service.security import token_matches

# Prometheus scrapes every 5-60 s over one kept-alive connection and sends its request at once.
METRICS_IDLE_TIMEOUT_S = 10.0  # a connection's time to send a whole request (the first, or the next)
METRICS_MAX_CONNECTIONS = 256  # past it the oldest connection is dropped for the newest

_LINGER_S = 1.0  # after an answer to a request with a body (none is expected), how long the rest is read and dropped

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def serve_registry(registry: CollectorRegistry, host: str, port: int, token: str | None,
                   idle_timeout_s: float) -> int:
    """Listen on host:port (0: any free port) and return the port; see starjar.service.metrics.serve."""
    coro = _listen(_handler(registry, token), host, port, idle_timeout_s)
    return asyncio.run_coroutine_threadsafe(coro, _metrics_loop()).result(30)


def _metrics_loop() -> asyncio.AbstractEventLoop:
    """The process's one metrics thread and its event loop, started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="metrics-http", daemon=True).start()
        return _loop


def _handler(registry: CollectorRegistry, token: str | None):
    async def handle(request: web.BaseRequest) -> web.Response:
        if not token_matches(request.headers.get("Authorization"), token):
            return web.Response(status=401, text="send the cluster token: Authorization: Bearer <token>\n",
                                headers={"WWW-Authenticate": 'Bearer realm="starjar"'})
        names = request.query.getall("name[]", [])  # filtering, as prometheus_client's own server does it
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(registry.restricted_registry(names) if names else registry)
        return web.Response(body=body, headers={"Content-Type": content_type})
    return handle


async def _listen(handle, host: str, port: int, idle_timeout_s: float) -> int:
    # The address family of the host given (an IPv6 host such as :: or ::1 needs AF_INET6), as prometheus_client's
    # own server chooses it; one family, so port 0 gives one port. No access log: it would carry client addresses.
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    factory = _BoundedServer(handle, METRICS_MAX_CONNECTIONS, keepalive_timeout=idle_timeout_s,
                             lingering_time=_LINGER_S, access_log=None)
    server = await asyncio.get_running_loop().create_server(factory, host, port, family=family)
    return server.sockets[0].getsockname()[1]


class _BoundedServer(web.Server):
    """aiohttp's low-level server holding at most `max_connections` open: past it, the oldest is dropped."""

    def __init__(self, handler, max_connections: int, **kwargs):
        super().__init__(handler, **kwargs)
        self.max_connections = max_connections

    def connection_made(self, handler, transport) -> None:
        super().connection_made(handler, transport)
        live = [c for c in self.connections if c.transport is not None and not c.transport.is_closing()]
        if len(live) > self.max_connections:
            live[0].transport.abort()
