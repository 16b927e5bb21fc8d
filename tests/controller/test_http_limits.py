"""The OpenAI HTTP port and the metrics ports against hostile clients: large bodies are parsed off the event loop,
slow and idle connections are closed, an oversized body is refused unread, and idle sockets on a metrics port hold
no thread each."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import grpc
import pytest

from controller.frontend import openai_http
from controller.frontend.limits import MAX_BODY_BYTES, HttpLimits
from controller.frontend.openai_protocol import parse_completions, parse_json
from controller.frontend.server import FrontEnd
from starjar.service.metrics import new_registry, scrape, serve
from starjar.service.serving import BackgroundLoop
from starjar.v1 import generate_pb2 as pb
from starjar.v1 import generate_pb2_grpc as pb_grpc

TICK_S = 0.02  # the fake worker's time per token
BIG_IDS = 460_000  # token ids in a flood body: about 3.7 MB of JSON
FLOOD = 24


class _Ticking(pb_grpc.GenerateServiceServicer):
    """A token every TICK_S until the caller leaves; a long prompt (a flood body) finishes at once."""

    async def Generate(self, request, context):
        if len(request.prompt_token_ids) > 1000:
            yield pb.GenerateResponse(request_id=request.request_id, finish_reason="length")
            return
        while True:
            await asyncio.sleep(TICK_S)
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[5], text="x")


@pytest.fixture(scope="module")
def worker():
    loop = BackgroundLoop("test-ticking-worker")

    async def start():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        pb_grpc.add_GenerateServiceServicer_to_server(_Ticking(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port
    server, port = loop.run(start())
    yield f"127.0.0.1:{port}"
    loop.run(server.stop(0))
    loop.stop()


@pytest.fixture
def front_end(worker, request):
    fe = FrontEnd("tiny", None, http_limits=getattr(request, "param", HttpLimits())).start()
    fe.set_targets({"w0": worker})
    yield fe
    fe.stop(0.5)


def _post_head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0


# ---- large bodies and the event loop --------------------------------------------------------------------------

class _Stream(threading.Thread):
    """A streaming completion read on its own thread: when each piece of it arrived."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 60000, "stream": True}).encode()
        self.sock.sendall(_post_head(len(body)) + body)
        self.arrivals: list[float] = []
        self.start()

    def run(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                if b"data:" in chunk:
                    self.arrivals.append(time.monotonic())
        except OSError:
            pass  # closed by the test

    def largest_gap(self, start: float, end: float) -> float:
        seen = [t for t in self.arrivals if start <= t <= end]
        return max(b - a for a, b in zip(seen, seen[1:], strict=False))


def _flood(port: int, body: bytes, n: int) -> list[int]:
    """n bodies sent at once, the last byte of each held back until all the rest is in, so that they all complete
    together (the worst case for a loop that parses them itself)."""
    statuses: list[int] = []
    gate = threading.Barrier(n)

    def one() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
            s.sendall(_post_head(len(body)) + body[:-1])
            gate.wait()
            time.sleep(0.3)  # the server has read what was sent
            s.sendall(body[-1:])
            statuses.append(_status(_read_all(s)))
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return statuses


def _one_parse(body: bytes) -> float:
    """Seconds to parse and check one body here, on this machine as loaded as it is now."""
    t0 = time.monotonic()
    parse_completions(parse_json(body, "application/json"), "tiny")
    return time.monotonic() - t0


def test_a_flood_of_large_valid_bodies_does_not_stall_a_running_stream(front_end):
    body = json.dumps({"prompt": list(range(100_000, 100_000 + BIG_IDS)), "max_tokens": 4}).encode()
    one = min(_one_parse(body) for _ in range(2))
    stream = _Stream(front_end.http_port)
    try:
        time.sleep(0.5)  # streaming by now
        t0 = time.monotonic()
        time.sleep(1.0)
        alone = stream.largest_gap(t0, time.monotonic())
        t1 = time.monotonic()
        statuses = _flood(front_end.http_port, body, FLOOD)
        flooded = stream.largest_gap(t1, time.monotonic())
    finally:
        stream.sock.close()
    print(f"largest gap between chunks: alone {alone * 1e3:.0f} ms, under {FLOOD} x {len(body) / 1e6:.1f} MB "
          f"bodies {flooded * 1e3:.0f} ms (one body parses in {one * 1e3:.0f} ms)")
    assert statuses == [200] * FLOOD
    # Parsed on the loop, bodies that arrive together stall it for the sum of their parses (seconds). Parsed on a
    # thread, the loop waits only while that thread holds the GIL in one C call (json.loads), a few times over
    # when the other threads of this process win the GIL first: about one parse.
    assert flooded < 4 * alone + 4 * one, (alone, one, flooded)


def test_large_bodies_are_parsed_off_the_event_loop(front_end, monkeypatch):
    seen: list[str] = []
    parse = openai_http.parse_json

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return parse(*a, **k)
    monkeypatch.setattr(openai_http, "parse_json", spy)
    big = json.dumps({"prompt": list(range(1000, 1000 + 50_000)), "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", front_end.http_port), timeout=30) as s:
        s.sendall(_post_head(len(big)) + big)
        assert _status(_read_all(s)) == 200
    assert seen and "frontend-loop" not in seen, seen


# ---- slow and idle connections on the HTTP port ---------------------------------------------------------------

SHORT = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0)


def _closed_within(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """What the server sent before closing, and when it closed; fails past `limit` seconds."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    raw = b""
    try:
        while chunk := sock.recv(65536):
            raw += chunk
    except ConnectionResetError:
        pass  # closed with the client's bytes unread: a reset, which is a close too
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {limit} s")
    return raw, time.monotonic() - t0


@pytest.mark.parametrize("front_end", [SHORT], indirect=True)
def test_partial_headers_are_closed_after_the_header_timeout(front_end):
    with socket.create_connection(("127.0.0.1", front_end.http_port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more
        _, took = _closed_within(s, 6.0)
    assert took >= 0.5, took
    with socket.create_connection(("127.0.0.1", front_end.http_port)) as s:  # nothing sent at all
        _closed_within(s, 6.0)


@pytest.mark.parametrize("front_end", [SHORT], indirect=True)
def test_a_body_that_stops_arriving_is_answered_408_within_the_body_timeout(front_end):
    with socket.create_connection(("127.0.0.1", front_end.http_port)) as s:
        s.sendall(_post_head(4_000_000) + b'{"prompt": "' + b"a" * (1 << 20))
        raw, took = _closed_within(s, 8.0)
    assert _status(raw) == 408 and b"body" in raw, raw[:300]
    assert took >= 0.5, took


@pytest.mark.parametrize("declared", [10**12, MAX_BODY_BYTES + 1])
def test_a_content_length_past_the_limit_is_refused_at_once_unread(front_end, declared):
    with socket.create_connection(("127.0.0.1", front_end.http_port)) as s:
        s.sendall(_post_head(declared) + b"{" * 1000)
        t0 = time.monotonic()
        s.settimeout(5.0)
        head = s.recv(65536)
        took = time.monotonic() - t0
    assert _status(head) == 413 and str(MAX_BODY_BYTES).encode() in head, head[:300]
    assert took < 2.0, took


# ---- metrics ports --------------------------------------------------------------------------------------------

def _threads() -> int:
    return threading.active_count()


def test_idle_sockets_on_a_metrics_port_hold_no_threads_and_are_closed():
    token = "m" * 40
    port = serve(new_registry("hostile"), "127.0.0.1", 0, token=token, idle_timeout_s=1.0)
    assert "starjar_build_info" in scrape(f"127.0.0.1:{port}", token)
    before = _threads()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        for s in idle[::2]:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half of them mid-headers
        time.sleep(0.3)
        assert _threads() - before <= 2, (before, _threads())
        assert "starjar_build_info" in scrape(f"127.0.0.1:{port}", token, timeout=5)
        for s in idle:
            _closed_within(s, 6.0)
    finally:
        for s in idle:
            s.close()
    assert "starjar_build_info" in scrape(f"127.0.0.1:{port}", token, timeout=5)
