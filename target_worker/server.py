"""A target worker process: engine thread + GenerateService (+ health, reflection)."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from starjar.models import LoadedModel
from starjar.policy import FixedGamma, SpeculationPolicy
from starjar.v1 import generate_pb2, generate_pb2_grpc
from target_worker.draft_client import RemoteProposer
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.runner import EngineRunner
from target_worker.service import GenerateService

log = logging.getLogger(__name__)
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


class TargetServer:
    def __init__(self, model: LoadedModel, draft_address: str | None, worker_id: str,
                 policy: SpeculationPolicy | None = None, config: EngineConfig | None = None,
                 host: str = "127.0.0.1", port: int = 0, draft_deadline_s: float = 0.5):
        self.proposer = (RemoteProposer(draft_address, model.fingerprint, worker_id, draft_deadline_s)
                         if draft_address else None)
        engine = TargetEngine(model, self.proposer, policy or FixedGamma(4 if draft_address else 0), config)
        self.runner = EngineRunner(engine)
        self.host, self.requested_port = host, port
        self.port: int | None = None
        self.model_name = model.path.rstrip("/").split("/")[-1]
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()

    async def start(self) -> int:
        self._server = grpc.aio.server()
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateService(self.runner, self.model_name),
                                                                self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server)
        self.port = self._server.add_insecure_port(f"{self.host}:{self.requested_port}")
        self.runner.start()
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("target worker on %s:%d (model %s, draft %s)", self.host, self.port, self.model_name,
                 self.proposer.address if self.proposer else "none")
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is None:
            return
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.stop(grace)
        self.runner.stop()
        if self.proposer:
            self.proposer.close()
        self._server = None


async def _serve(server: TargetServer, on_ready=None) -> None:
    port = await server.start()
    if on_ready:
        on_ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def serve_forever(server: TargetServer, on_ready=None) -> None:
    try:
        import uvloop

        uvloop.run(_serve(server, on_ready))
    except ImportError:
        asyncio.run(_serve(server, on_ready))
