"""Generations streamed on their own threads, for tests that act while tokens are flowing (drain, faults)."""

from __future__ import annotations

import threading
import time

from starjar import Client, Unavailable


class Stream(threading.Thread):
    """One generation streamed on its own thread: its tokens so far, its finish reason, or its error."""

    def __init__(self, address: str, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.address, self.prompt, self.max_tokens = address, prompt, max_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with Client(self.address, timeout=180) as c:
                for chunk in c.generate_stream(prompt_token_ids=self.prompt, max_tokens=self.max_tokens):
                    self.tokens += chunk.token_ids
                    self.finish_reason = chunk.finish_reason or self.finish_reason
        except Exception as exc:  # noqa: BLE001 - any failure is the test's failure
            self.error = exc


def wait_streaming(streams: list[Stream], n: int = 1, timeout: float = 60.0) -> None:
    """Until at least n of the streams have received tokens."""
    deadline = time.time() + timeout
    while sum(bool(s.tokens) for s in streams) < n:
        assert time.time() < deadline, f"fewer than {n} streams produced tokens in {timeout:.0f} s"
        assert not any(s.error for s in streams), [s.error for s in streams]
        time.sleep(0.01)


def refused_while_draining(address: str, timeout: float = 10.0) -> Unavailable:
    """Probe with one-token requests until one is refused (UNAVAILABLE); those that got in before the drain began
    must simply finish."""
    deadline = time.time() + timeout
    with Client(address, timeout=30) as c:
        while time.time() < deadline:
            try:
                assert c.generate("probe", max_tokens=1).finish_reason in ("stop", "length")
            except Unavailable as exc:
                return exc
            time.sleep(0.01)
    raise AssertionError(f"new requests were still accepted {timeout:.0f} s after the drain began")
