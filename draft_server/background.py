"""Run a DraftServer on its own event loop in a background thread (tests, benchmarks, actors)."""

from __future__ import annotations

import asyncio
import threading

from draft_server.config import DraftServerConfig
from draft_server.server import DraftServer
from starjar.model.loading import LoadedModel


class BackgroundDraftServer:
    def __init__(self, model: LoadedModel, cfg: DraftServerConfig | None = None, security=None):
        self.server = DraftServer(model, cfg, security)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="draft-server-loop", daemon=True)

    def start(self) -> BackgroundDraftServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)
        return self

    @property
    def address(self) -> str:
        return f"{self.server.host}:{self.server.port}"

    def call(self, fn, *args):
        """Run fn(*args) on the server's loop (its state is not thread-safe)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def stop(self, grace: float = 2.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(timeout=grace + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
