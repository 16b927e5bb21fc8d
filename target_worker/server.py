"""A target worker process: engine thread + GenerateService (+ health, reflection)."""

from __future__ import annotations

import asyncio
import logging
import os

import grpc

from starjar.model.loading import LoadedModel
from starjar.service.drain import DrainGate
from starjar.service.security import Security
from starjar.service.serving import HealthAndReflection, run_until_signalled
from starjar.service.status import ErrorStatus
from starjar.spec.policy import FixedGamma, SpeculationPolicy
from starjar.v1 import generate_pb2, generate_pb2_grpc
from target_worker.admission import AdmissionQueue
from target_worker.config import TargetWorkerConfig
from target_worker.engine import TargetEngine
from target_worker.remote.client import RemoteProposer
from target_worker.runner import EngineRunner
from target_worker.service import GenerateService

log = logging.getLogger(__name__)
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


class TargetServer:
    def __init__(self, model: LoadedModel, cfg: TargetWorkerConfig | None = None,
                 policy: SpeculationPolicy | None = None, security: Security | None = None):
        """policy: picks gamma each step (default: 4 with a draft server, else 0). security: the cluster token
        and TLS, for this server and for its calls to the draft server (default: neither)."""
        self.cfg = cfg = cfg or TargetWorkerConfig()
        self.security = security or Security()
        self.proposer = (RemoteProposer(cfg.draft_server, model.fingerprint, cfg.worker_id, cfg.draft_deadline_s,
                                        security=self.security)
                         if cfg.draft_server else None)
        engine = TargetEngine(model, self.proposer, policy or FixedGamma(4 if cfg.draft_server else 0), cfg.engine)
        engine.send_ahead = self.proposer.send_ahead if self.proposer is not None else None
        if self.proposer is not None:  # prompts with their KV, where the server's draft is this target's copy
            self.proposer.hand_prompt_kv(model)
            engine.seed_draft = self.proposer.seed
        self.model_name = model.path.rstrip("/").split("/")[-1]
        from target_worker.metrics import TargetMetrics

        self.metrics = TargetMetrics(engine, self.proposer, self.model_name)
        self.runner = EngineRunner(engine, self.metrics, on_dead=self._on_engine_dead)
        self.admission = AdmissionQueue(engine.config.max_batch_size, cfg.max_waiting)
        self.metrics.registry.register(self.admission)  # held, limit, refused: read at scrape time
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health: HealthAndReflection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.gate = DrainGate(SERVICE_NAME)

    async def start(self) -> int:
        self._server = grpc.aio.server(interceptors=[*self.security.interceptors(), self.gate, ErrorStatus()])
        service = GenerateService(self.runner, self.model_name, self.admission)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(service, self._server)
        self._health = HealthAndReflection(self._server, SERVICE_NAME)
        self.port = self.security.add_port(self._server, f"{self.cfg.host}:{self.cfg.port}")
        self._loop = asyncio.get_running_loop()
        self.runner.start()
        await self._server.start()
        await self._health.set_serving(True)
        log.info("target worker on %s:%d (model %s, draft %s)", self.cfg.host, self.port, self.model_name,
                 self.proposer.address if self.proposer else "none")
        return self.port

    def _on_engine_dead(self) -> None:
        """From the engine's thread: turn NOT_SERVING (and exit) on the server's loop."""
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._engine_died()))

    async def _engine_died(self) -> None:
        exiting = self.cfg.exit_on_engine_death
        log.error("target engine stopped: health NOT_SERVING%s", "; exiting" if exiting else "")
        if self._health is not None:
            await self._health.set_serving(False)
        if exiting:
            await asyncio.sleep(1.0)  # let the failed requests' errors reach their clients
            os._exit(70)

    async def drain(self, timeout: float) -> int:
        """Refuse new generations (UNAVAILABLE "draining", health NOT_SERVING) and wait up to `timeout` s for
        those in flight to finish; how many are left."""
        self.gate.start_draining()
        if self._health is not None:
            await self._health.set_serving(False)
        return await self.gate.wait_idle(timeout)

    async def stop(self, grace: float = 1.0, drain_timeout: float | None = None) -> None:
        """Drain (drain_timeout, default the server's), then close; what is still running after that gets
        `grace` seconds more before it is cancelled."""
        if self._server is None:
            return
        left = await self.drain(self.cfg.drain_timeout_s if drain_timeout is None else drain_timeout)
        if left:
            log.warning("drain timed out with %d generation(s) in flight; cancelling them", left)
        await self._server.stop(grace)
        self.runner.stop()
        if self.proposer:
            self.proposer.close()
        self._server = None


def serve_forever(server: TargetServer, on_ready=None) -> None:
    run_until_signalled(server.start, server.stop, on_ready)
