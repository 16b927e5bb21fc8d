"""Ports and plain HTTP on 127.0.0.1: a port nothing listens on yet, and a GET with an optional bearer token
(a metrics endpoint, Prometheus' API)."""

from __future__ import annotations

import socket
import urllib.request


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, token: str | None = None) -> bytes:
    """The body of a GET of `url`, sent with `Authorization: Bearer token` when a token is given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
        return resp.read()
