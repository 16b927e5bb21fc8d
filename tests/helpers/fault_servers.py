"""Servers for front-end fault tests: real target workers on loopback (optionally slowed, broken or with a slow
tokenizer: fault injection on a copy of the model, never on the shared one) and fake GenerateServices that
refuse or never answer."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from starjar.service.serving import BackgroundLoop
from starjar.v1 import generate_pb2_grpc as pb_grpc
from target_worker.config import TargetWorkerConfig
from target_worker.engine import EngineConfig
from target_worker.server import TargetServer


def own_copy(model):
    """A LoadedModel that shares the weights but whose attributes can be replaced without touching others'."""
    return type(model)(**{**model.__dict__})


def slowed(model, seconds: float):
    """Every forward pass takes `seconds` longer: requests stay in flight long enough to observe."""
    copy, forward = own_copy(model), model.forward

    def slow(*a, **k):
        time.sleep(seconds)
        return forward(*a, **k)
    object.__setattr__(copy, "forward", slow)
    return copy


def broken(model, gate: threading.Event | None = None, entered: threading.Event | None = None):
    """Every forward pass raises: the engine fails its steps, then stops. With a gate, each pass first sets
    `entered` and waits for the gate to open (so requests can be queued behind it)."""
    copy = own_copy(model)

    def fail(*a, **k):
        if gate is not None:
            entered.set()
            gate.wait(30)
        raise RuntimeError("injected fault")
    object.__setattr__(copy, "forward", fail)
    return copy


class GatedTokenizer:
    """A tokenizer that blocks on `gate` for prompts starting with "SLOW" (a huge prompt, in effect)."""

    def __init__(self, inner):
        self.inner = inner
        self.entered = threading.Event()  # a SLOW prompt is being tokenized
        self.gate = threading.Event()

    def __call__(self, text, *a, **k):
        if isinstance(text, str) and text.startswith("SLOW"):
            self.entered.set()
            self.gate.wait(30)
        return self.inner(text, *a, **k)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Worker:
    """A TargetServer on its own loop; `address` to call it."""

    def __init__(self, model, name: str, batch_size: int = 4, **server_kw):
        self.loop = BackgroundLoop(f"test-{name}")
        cfg = TargetWorkerConfig(worker_id=name, engine=EngineConfig(max_batch_size=batch_size), **server_kw)
        self.server = TargetServer(model, cfg)
        self.loop.run(self.server.start())
        self.address = f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.loop.run(self.server.stop(0.5))
        self.loop.stop()


class FakeGenerate(pb_grpc.GenerateServiceServicer):
    """Answers every Generate with `code`, or never answers (code None). Counts the calls it got."""

    def __init__(self, code: grpc.StatusCode | None):
        self.code = code
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        if self.code is None:
            await asyncio.Event().wait()  # a worker that hangs: TCP stays open, nothing comes back
        await context.abort(self.code, "injected")


class FakeWorker:
    def __init__(self, code: grpc.StatusCode | None):
        self.service = FakeGenerate(code)
        self.loop = BackgroundLoop("test-fake-worker")

        async def start():
            self._server = grpc.aio.server()
            pb_grpc.add_GenerateServiceServicer_to_server(self.service, self._server)
            port = self._server.add_insecure_port("127.0.0.1:0")
            await self._server.start()
            return port
        self.address = f"127.0.0.1:{self.loop.run(start())}"

    def close(self) -> None:
        self.loop.run(self._server.stop(0))
        self.loop.stop()


def wait_until(predicate, timeout: float = 10.0, every: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
