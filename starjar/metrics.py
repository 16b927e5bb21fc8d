"""What every component's Prometheus metrics share: a registry per server, bucket conventions,
`starjar_build_info`, and the HTTP endpoint that serves them.

Names are `starjar_<component>_<what>_<unit>`: base units (seconds, bytes, ratios
0-1), `_total` on counters, and only bounded labels (a finish reason, a gamma,
a batch-size bucket, a target worker's name): never a request id, a prompt, a
tag or a client address. A registry per server (not the process-wide default)
lets tests and benchmarks run several servers in one process.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Gauge, make_wsgi_app

from starjar.version import __version__

# vLLM's bucket conventions, so dashboards built for vLLM read starjar the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# Draft-server timings are milliseconds-scale: finer at the low end.
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def new_registry(component: str, **models: str) -> CollectorRegistry:
    """A registry holding `starjar_build_info` for this component."""
    registry = CollectorRegistry()
    labels = {"version": __version__, "component": component,
              "target_model": models.get("target_model", ""), "draft_model": models.get("draft_model", "")}
    info = Gauge("starjar_build_info", "starjar version, component and models (value is always 1)",
                 list(labels), registry=registry)
    info.labels(**labels).set(1)
    return registry


def serve(registry: CollectorRegistry, host: str, port: int = 0, token: str | None = None) -> int:
    """Serve /metrics for this registry (plus the process's CPU and memory) on host:port; returns the port.
    token: the cluster token; when set, a scrape must send `Authorization: Bearer <token>` (Prometheus:
    `authorization.credentials_file`) and anything else gets 401, as every gRPC port of the cluster does."""
    from starjar.security import token_matches

    registry.register(_ProcessOnly())
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        if token_matches(environ.get("HTTP_AUTHORIZATION"), token):
            return metrics(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="starjar"')])
        return [b"send the cluster token: Authorization: Bearer <token>\n"]

    # The address family of the host given (an IPv6 host such as :: or ::1 needs AF_INET6), as prometheus_client's
    # own server chooses it.
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port


def scrape(address: str, token: str | None = None, timeout: float = 10.0) -> str:
    """The text of host:port/metrics, sending the cluster token when there is one."""
    import urllib.request

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(f"http://{address}/metrics", headers=headers),
                                timeout=timeout) as resp:
        return resp.read().decode()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scrape never holds the process open


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # one line per scrape every 5 s is noise, not a log
        pass


class _ProcessOnly:
    """process_* and python_info from the default collectors, added once to a served registry."""

    def collect(self):
        yield from PROCESS_COLLECTOR.collect()
        yield from PLATFORM_COLLECTOR.collect()


def batch_bucket(batch_size: int) -> str:
    """A bounded label for a batch size: 1, 2-3, 4-7, ... 64+."""
    if batch_size >= 64:
        return "64+"
    lo = 1
    while lo * 2 <= batch_size:
        lo *= 2
    return "1" if lo == 1 else f"{lo}-{lo * 2 - 1}"
