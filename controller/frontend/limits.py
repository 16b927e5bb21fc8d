"""The front end's overload limits, their defaults and checks (light: the CLI and ClusterSpec import it)."""

from __future__ import annotations

from dataclasses import dataclass

from starjar.errors import InvalidArgument

DEFAULT_MAX_REQUESTS = 1024  # relays in flight at once, over all workers; past it 429 / RESOURCE_EXHAUSTED
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a whole generation, queueing included (the OpenAI SDK's own default)
# Four times the longest text prompt (starjar.wire.request.MAX_PROMPT_CHARS) in ASCII; a body past it is a 413.
MAX_BODY_BYTES = 4 << 20


def check_max_requests(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument("--max-requests", "must be an integer >= 1", n)
    return n


def check_request_timeout(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise InvalidArgument("--request-timeout", "must be > 0 seconds", seconds)
    return float(seconds)


@dataclass(frozen=True)
class HttpLimits:
    """How long the OpenAI HTTP port waits on one client, and how much it takes from one.

    header_timeout_s: from the connection (or the end of its previous response) to the end of the next request's
    headers; an idle keep-alive connection is closed after it too. body_timeout_s: from the end of the headers to
    the end of the body (then 408). A declared Content-Length past max_body_bytes is a 413 before any of the body
    is read. linger_s: after an early answer (408, 413), how long the rest of the body is read and dropped, so the
    client sees the answer before the close."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = MAX_BODY_BYTES
    linger_s: float = 2.0

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "linger_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(name, "must be > 0 seconds", value)
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < 1:
            raise InvalidArgument("max_body_bytes", "must be an integer >= 1", self.max_body_bytes)


DEFAULT_HTTP_LIMITS = HttpLimits()
