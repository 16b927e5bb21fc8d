"""What every component's Prometheus metrics share: a registry per server, bucket conventions,
`starjar_build_info`, and the HTTP endpoint that serves them.

Names are `starjar_<component>_<what>_<unit>`: base units (seconds, bytes, ratios
0-1), `_total` on counters, and only bounded labels (a finish reason, a gamma,
a batch-size bucket, a target worker's name): never a request id, a prompt, a
tag or a client address. A registry per server (not the process-wide default)
lets tests and benchmarks run several servers in one process.

Every metrics port of a process is served by one event loop on one thread
(starjar.service.metrics_http), so a connection costs a socket, not a thread; one that
has not sent a whole request within the idle timeout is closed, and past
METRICS_MAX_CONNECTIONS the oldest is dropped for the newest.
"""

from __future__ import annotations

from prometheus_client import PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Gauge

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


def serve(registry: CollectorRegistry, host: str, port: int = 0, token: str | None = None,
          idle_timeout_s: float | None = None) -> int:
    """Serve /metrics for this registry (plus the process's CPU and memory) on host:port; returns the port.
    token: the cluster token; when set, a scrape must send `Authorization: Bearer <token>` (Prometheus:
    `authorization.credentials_file`) and anything else gets 401, as every gRPC port of the cluster does.
    idle_timeout_s: how long a connection may take to send a whole request (the first, or the next one;
    default metrics_http.METRICS_IDLE_TIMEOUT_S)."""
    from starjar.service.metrics_http import METRICS_IDLE_TIMEOUT_S, serve_registry  # aiohttp: loaded when served

    idle_timeout_s = METRICS_IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
    if isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, (int, float)) or not idle_timeout_s > 0:
        raise ValueError(f"idle_timeout_s must be > 0 seconds, not {idle_timeout_s!r}")
    registry.register(_ProcessOnly())
    return serve_registry(registry, host, port, token, idle_timeout_s)


def scrape(address: str, token: str | None = None, timeout: float = 10.0) -> str:
    """The text of host:port/metrics, sending the cluster token when there is one."""
    import urllib.request

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(f"http://{address}/metrics", headers=headers),
                                timeout=timeout) as resp:
        return resp.read().decode()


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
