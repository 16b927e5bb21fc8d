"""The Ray actors that run a starjar cluster's servers: the draft server, the target workers, the front end.

Each starts its gRPC server on a free port of its node and answers `info()`
with where it listens; the controller reads that and publishes it. A restarted
actor starts on a new port; the controller notices and republishes, and target
workers find the draft server again by asking the controller (never a fixed
address). Model actors set their torch threads (for every thread that
computes) and a short OpenMP spin before torch loads, because they share
cores with each other (controller.cluster.omp_env).

Each also has `stop()`, which the controller calls before it kills the actor
(after draining the targets, see Controller.drain), so that what a server has
accepted ends with its last message sent rather than with a killed process.
"""

from __future__ import annotations

import logging
import os

import ray

from controller.cluster.omp_env import share_cores
from controller.cluster.spec import CONTROLLER, NAMESPACE, ClusterSpec

log = logging.getLogger(__name__)


def _prepare_process(spec: ClusterSpec, threads: int | None = None) -> None:
    threads = threads or spec.threads
    share_cores()  # must precede the torch import (the keeper set it for Ray's workers too)
    # Ray starts each worker with OMP_NUM_THREADS=1 when the user set none. torch.set_num_threads() below then
    # holds for this (the actor's main) thread only: OpenMP gives every other thread the environment's count,
    # so the engine and draft compute threads ran on one core whatever --threads said (2-core AMD EPYC: a
    # 2000 x 2000 matmul 173 vs 92 ms; a batch-1 draft step, mostly small ops, 13.2 vs 11.7 ms). Set before
    # torch loads.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(threads)


def _device(spec: ClusterSpec) -> str:
    if spec.device == "auto":
        return "cuda" if ray.get_gpu_ids() else "cpu"
    return spec.device


def _security(spec: ClusterSpec):
    """Every actor's server requires the cluster token, and every internal call carries it."""
    from starjar.service.security import Security

    return Security(token=spec.cluster_token)


def _start_metrics(registry, host: str, spec: ClusterSpec) -> str:
    from starjar.service.metrics import serve

    return f"{host}:{serve(registry, host, token=spec.cluster_token)}"


class DraftServerActor:
    def __init__(self, spec: dict):
        self.spec = ClusterSpec.from_dict(spec)
        _prepare_process(self.spec, self.spec.draft_threads)
        from draft_server.background import BackgroundDraftServer
        from starjar.cpu.kernels import hand_threads_to_compute
        from starjar.model.loading import load_model

        self.host = ray.util.get_node_ip_address()
        model = load_model(self.spec.draft, _device(self.spec), self.spec.dtype, what="draft")
        self.fingerprint = model.fingerprint  # the controller gives it only targets with this tokenizer
        hand_threads_to_compute()  # the draft compute thread owns the cores from here
        cfg = self.spec.draft_server_config(self.host)
        self.server = BackgroundDraftServer(model, cfg, _security(self.spec)).start()
        registry = self.server.server.metrics.registry
        self.metrics = _start_metrics(registry, self.host, self.spec) if self.spec.metrics else None
        log.info("draft server actor ready at %s", self.server.address)

    def info(self) -> dict:
        return {"address": self.server.address, "metrics": self.metrics, "pid": os.getpid(),
                "fingerprint": self.fingerprint}

    def stats(self) -> dict:
        """The same numbers as the GetStats RPC, read through it."""
        from google.protobuf.json_format import MessageToDict

        from starjar.v1 import draft_pb2, draft_pb2_grpc

        security = _security(self.spec)
        with security.channel(self.server.address) as ch:
            msg = draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.GetStatsRequest(), timeout=5,
                                                               metadata=security.metadata())
        return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def set_max_targets(self, n: int) -> None:
        self.server.call(self.server.server.set_max_targets, n)

    def stop(self) -> None:
        """Answer the rounds queued, refuse new ones (targets decode on without drafts), close."""
        self.server.stop(grace=1.0)


def _resolve_draft_address(target: str, lost: str | None) -> str | None:
    """Ask the controller where this target's draft server is now (None: unknown yet, or none has room).
    `lost`: the address the target was attached to or tried last; the controller checks it is still there."""
    controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    return ray.get(controller.draft_address.remote(target, lost), timeout=5)


class TargetWorkerActor:
    def __init__(self, spec: dict, name: str):
        self.spec = ClusterSpec.from_dict(spec)
        self.name = name
        _prepare_process(self.spec)
        from starjar.cpu.kernels import hand_threads_to_compute
        from starjar.model.loading import load_model
        from starjar.service.serving import BackgroundLoop
        from starjar.spec.policies import parse_buckets, serving_policy
        from target_worker.config import TargetWorkerConfig, engine_config
        from target_worker.server import TargetServer
        from target_worker.tree_budget import tree_config

        self.host = ray.util.get_node_ip_address()
        model = load_model(self.spec.target, _device(self.spec), self.spec.dtype, what="target")
        self.fingerprint = model.fingerprint
        draft = self._draft_address if self.spec.draft else None
        self.policy = serving_policy(self.spec.policy, self.spec.gamma, self.spec.profile, bool(self.spec.draft),
                                     parse_buckets(self.spec.buckets))
        tree, tree_note = tree_config(self.spec.tree, self.spec.tree_width, self.spec.tree_cap, self.spec.tree_budget,
                                      self.spec.profile, model)
        log.info("%s: %s", name, tree_note)
        hand_threads_to_compute()  # the engine thread owns the cores from here
        cfg = TargetWorkerConfig(worker_id=name, draft_server=draft, host=self.host, port=0,
                                 draft_deadline_s=self.spec.draft_deadline_s,
                                 drain_timeout_s=self.spec.drain_timeout_s, max_waiting=self.spec.max_waiting,
                                 exit_on_engine_death=True,  # Ray restarts the actor
                                 engine=engine_config(self.spec.batch_size, self.spec.gamma, tree=tree))
        self.server = TargetServer(model, cfg, self.policy, _security(self.spec))
        self.loop = BackgroundLoop("target-server-loop")
        self.loop.run(self.server.start())
        self.metrics = _start_metrics(self.server.metrics.registry, self.host, self.spec) if self.spec.metrics else None
        log.info("target worker %s ready at %s:%d", name, self.host, self.server.port)

    def _draft_address(self) -> str | None:
        """The draft client's resolver (called from its attach thread, possibly before self.server is set)."""
        proposer = getattr(getattr(self, "server", None), "proposer", None)
        return _resolve_draft_address(self.name, (proposer.address or None) if proposer else None)

    def info(self) -> dict:
        proposer = self.server.proposer
        return {"address": f"{self.host}:{self.server.port}", "metrics": self.metrics, "pid": os.getpid(),
                "draft_attached": bool(proposer and proposer.attached), "fingerprint": self.fingerprint,
                "draft_address": proposer.address if proposer and proposer.attached else None,
                "draft_attached_at": proposer.attached_at if proposer else None}

    def follow_draft(self) -> None:
        """The controller moved this target to another draft server: drop the stream, ask where to attach."""
        if self.server.proposer is not None:
            self.server.proposer.follow()

    def stats(self) -> dict:
        engine = self.server.runner.engine
        s = engine.stats
        out = {"running": engine.num_running, "waiting": engine.num_waiting, "policy": self.policy.name,
               "override": self.policy.override,
               "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
               "decode_steps": s.decode_steps, "tree_rounds": s.tree_rounds, "tree_nodes": s.tree_nodes,
               **s.step_kinds()}
        if self.server.proposer:
            out["fallbacks"] = dict(self.server.proposer.stats.fallbacks)
            out["draft_address"] = self.server.proposer.address
        return out

    def set_gamma(self, gamma: int | None) -> None:
        """Force a speculation length (0 = off), or None to hand control back to the policy."""
        if gamma is not None and gamma < 0:
            raise ValueError("gamma must be >= 0")
        self.policy.override = gamma if (gamma is None or self.spec.draft) else 0

    def begin_drain(self) -> None:
        """From now on refuse new generations (UNAVAILABLE "draining"); those in flight go on."""
        self.loop.run(self.server.drain(timeout=0))

    def in_flight(self) -> int:
        """Generations accepted and not yet ended."""
        return self.server.gate.in_flight

    def stop(self) -> None:
        """Close the server (after the controller's drain: nothing is waited for here)."""
        self.loop.run(self.server.stop(grace=1.0, drain_timeout=0))


class FrontEndActor:
    def __init__(self, spec: dict):
        self.spec = ClusterSpec.from_dict(spec)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        from controller.frontend.server import FrontEnd

        tokenizer = AutoTokenizer.from_pretrained(self.spec.target, local_files_only=True)
        name = self.spec.target.rstrip("/").split("/")[-1]
        self.node = ray.util.get_node_ip_address()
        self.frontend = FrontEnd(name, tokenizer, self.spec.host, self.spec.grpc_port, self.spec.http_port,
                                 self.spec.auth_token, max_requests=self.spec.max_requests,
                                 request_timeout_s=self.spec.request_timeout_s,
                                 upstream=_security(self.spec), http_limits=self.spec.http_limits()).start()
        self.metrics = _start_metrics(self.frontend.registry, self.node, self.spec) if self.spec.metrics else None

    def info(self) -> dict:
        host = self.node if self.spec.host in ("0.0.0.0", "::") else self.spec.host
        return {"grpc": f"{host}:{self.frontend.grpc_port}", "http": f"http://{host}:{self.frontend.http_port}",
                "metrics": self.metrics, "pid": os.getpid()}

    def set_targets(self, addresses: dict[str, str]) -> None:
        self.frontend.set_targets(addresses)

    def in_flight(self) -> dict[str, int]:
        return self.frontend.in_flight()

    def stop(self) -> None:
        self.frontend.stop(grace=1.0)
