"""Running the draft service: gRPC (with health and reflection) + the compute thread.

`DraftServer` is usable in-process (tests, benchmarks, the Ray actor);
`starjar serve draft` runs it with `run_until_signalled`: uvloop and a
graceful SIGTERM: rounds already queued are answered, new ones are refused.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc

from draft_server.compute import ComputeLoop
from draft_server.config import DraftServerConfig
from draft_server.engine import DraftEngine
from draft_server.faults import Faults
from draft_server.service import DraftService
from draft_server.sessions import SessionTable
from draft_server.stats import ServerStats
from draft_server.tide.adaptation import Tide
from draft_server.work_queue import make_queue
from starjar.model import allocator
from starjar.model.loading import LoadedModel, kv_bytes_per_token
from starjar.model.prompt_kv import takes_prompt_kv, wire_bytes
from starjar.service.security import Security
from starjar.service.serving import HealthAndReflection
from starjar.service.status import ErrorStatus
from starjar.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServer:
    def __init__(self, model: LoadedModel, cfg: DraftServerConfig | None = None, security: Security | None = None):
        """cfg: every setting, the listening address included. security: the cluster token every RPC must carry,
        and TLS / mutual TLS (default: neither)."""
        from draft_server.metrics import DraftMetrics

        self.cfg = cfg = cfg or DraftServerConfig()
        self.security = security or Security()
        self.model = model
        self.host = cfg.host
        self.port: int | None = None
        draft_name = model.path.rstrip("/").split("/")[-1]
        self.metrics = DraftMetrics(self, draft_name)  # reads the server's state only when scraped
        self.stats = ServerStats(observer=self.metrics)
        self.queue = make_queue(cfg.mode, cfg.max_batch_rounds)
        self.sessions = SessionTable(cfg.max_targets, cfg.max_targets_per_caller, cfg.reclaim_after_s)
        allocator.keep_scratch_in_heap()  # the compute loop gives outgrown KV copies back (see there)
        self.kv_budget = kv_budget(model, cfg)
        engine = DraftEngine(model, max_sequences=cfg.max_targets * cfg.max_sequences_per_target,
                             max_kv_tokens=self.kv_budget[0], max_kv_tokens_per_owner=self.kv_budget[1],
                             on_reload=self.metrics.reload_s.observe)
        self.faults = Faults()  # chaos tests only: inert unless STARJAR_DRAFT_FAULTS is set
        self.tide = Tide(model, cfg.tide) if cfg.tide is not None else None
        self.compute = ComputeLoop(engine, self.queue, self.stats, cfg.mode, cfg.max_batch_rounds, self.faults,
                                   self.tide, cfg.pass_catchup_tokens, cfg.lookahead)
        vocab_size, tok_hash = model.fingerprint.split(":", 1)
        self.service = DraftService(cfg, self.sessions, self.queue, self.stats, (int(vocab_size), tok_hash),
                                    draft_name=draft_name, vocab_size=model.vocab_size, faults=self.faults)
        self.service.tide = self.tide
        self.service.prompt_kv_from = takes_prompt_kv(model)  # after Tide: its tap rules it out
        self.service.kv_token_bytes = wire_bytes(model, 1) if self.service.prompt_kv_from else 0
        self._server: grpc.aio.Server | None = None
        self._health: HealthAndReflection | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> int:
        c = self.cfg
        opts = [("grpc.max_receive_message_length", c.max_message_bytes),
                ("grpc.max_send_message_length", c.max_message_bytes),
                ("grpc.so_reuseport", 0),
                # A target host that vanished (no FIN, no RST) is found by an unanswered ping, not in hours.
                ("grpc.keepalive_time_ms", int(c.keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(c.keepalive_timeout_s * 1000)),
                ("grpc.http2.ping_timeout_ms", int(c.keepalive_timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                # The targets ping too (to find a hung draft server): allow it, every 5 s at most.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
                ("grpc.http2.max_ping_strikes", 0), ("grpc.http2.max_pings_without_data", 0)]
        self._server = grpc.aio.server(options=opts, interceptors=[*self.security.interceptors(), ErrorStatus()])
        draft_pb2_grpc.add_DraftServiceServicer_to_server(self.service, self._server)
        self._health = HealthAndReflection(self._server, SERVICE_NAME)
        self.port = self.security.add_port(self._server, f"{self.host}:{self.cfg.port}")
        self.compute.start()
        await self._server.start()
        await self._health.set_serving(True)
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("draft server on %s:%d (mode %s, N_max %d, draft %s, KV budget %d tokens, %d per target)",
                 self.host, self.port, self.cfg.mode, self.cfg.max_targets, self.service.draft_name,
                 *self.kv_budget)
        return self.port

    async def _sweep(self) -> None:
        period = max(0.05, min(5.0, self.cfg.lease_s / 4, self.cfg.stream_idle_s / 4))
        if self.cfg.offload_after_s:
            period = min(period, max(0.05, self.cfg.offload_after_s / 4))
        serving = True
        while True:
            await asyncio.sleep(period)
            # Health follows the compute thread: a server that cannot draft says so (targets then decode alone).
            if self.compute.is_alive() != serving:
                serving = self.compute.is_alive()
                if not serving:
                    log.error("the draft compute thread has stopped: health NOT_SERVING")
                await self._health.set_serving(serving)
            try:  # one failed sweep must not end reclaim and offload for the process's life
                self.service.reclaim_expired()
                if self.cfg.offload_after_s:
                    await asyncio.to_thread(self.compute.offload_if_idle, self.cfg.offload_after_s)
            except Exception:
                log.exception("lease sweep failed; trying again in %.2f s", period)

    def set_max_targets(self, n: int) -> None:
        """N_max, set by the controller. Attached targets stay; the draft engine's sequence cap follows."""
        self.sessions.max_targets = n
        self.compute.engine.max_sequences = max(1, n) * self.cfg.max_sequences_per_target

    async def stop(self, grace: float = 5.0) -> None:
        """Answer what is queued, refuse new rounds, then close."""
        if self._server is None:
            return
        await self._health.set_serving(False)
        self.service.start_draining()
        self.compute.tide = None  # no more training: the loop only answers what is queued
        if self.tide is not None:
            self.tide.close()
        self.faults.release()
        await self._server.stop(grace)
        if self._sweeper:
            self._sweeper.cancel()
        self.queue.close()
        self.compute.join(timeout=grace)
        self._server = None


def kv_budget(model: LoadedModel, cfg: DraftServerConfig) -> tuple[int, int]:
    """(global, per target) KV tokens: as configured, or a quarter of the device's memory and twice a
    target's fair share of it."""
    total = cfg.max_kv_tokens
    if total is None:
        if model.device.type == "cuda":
            import torch

            memory = torch.cuda.get_device_properties(model.device).total_memory
        else:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        total = max(cfg.max_tokens_per_sequence, memory // 4 // kv_bytes_per_token(model))
    per_target = cfg.max_kv_tokens_per_target
    if per_target is None:
        per_target = max(cfg.max_tokens_per_sequence, 2 * total // max(1, cfg.max_targets))
    return total, min(per_target, total)
