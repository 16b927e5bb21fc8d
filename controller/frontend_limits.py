"""The front end's overload limits, their defaults and checks (light: the CLI and ClusterSpec import it)."""

from __future__ import annotations

from starjar.errors import InvalidArgument

DEFAULT_MAX_REQUESTS = 1024  # relays in flight at once, over all workers; past it 429 / RESOURCE_EXHAUSTED
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a whole generation, queueing included (the OpenAI SDK's own default)
FRONT_END_FULL = "front_end_full"  # the refusal reason when the front end is at max_requests


def check_max_requests(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument("--max-requests", "must be an integer >= 1", n)
    return n


def check_request_timeout(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise InvalidArgument("--request-timeout", "must be > 0 seconds", seconds)
    return float(seconds)
