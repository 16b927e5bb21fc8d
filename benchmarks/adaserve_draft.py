"""Where `bench adaserve`'s drafts come from: a real `starjar serve draft` process over gRPC (the default, as a
user deploys it) or an in-process draft engine (--in-process-draft). Each engine of the bench gets its own
proposer: a fresh attach to the one draft server, closed when its run ends."""

from __future__ import annotations

import itertools

import grpc

from benchmarks.launch import ServerProcess
from draft_server.engine import DraftEngine
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.remote.client import RemoteProposer

DEADLINE_S = 2.0  # a draft round may take this long before a step decodes without it (trees at batch 8)


class DraftSource:
    def __init__(self, target, draft, draft_dir: str, in_process: bool):
        self.target, self.draft, self.in_process = target, draft, in_process
        self.proc = None if in_process else ServerProcess("draft", "--model", draft_dir, "--port", "0",
                                                          "--max-targets", "8", threads=1)
        self._ids = itertools.count()

    def describe(self) -> dict:
        if self.in_process:
            return {"draft": "in-process DraftEngine"}
        return {"draft": f"`starjar serve draft` process at {self.proc.address} (gRPC, 1 torch thread)",
                "draft_deadline_s": DEADLINE_S}

    def proposer(self):
        if self.in_process:
            return DraftEngine(self.draft)
        rp = RemoteProposer(self.proc.address, self.target.fingerprint, f"adaserve-{next(self._ids)}", DEADLINE_S,
                            backoff_s=(0.02, 0.2))
        if not rp.wait_attached(30):
            raise RuntimeError("the draft server did not admit the bench's target")
        return rp

    def stats(self) -> dict:
        """The draft's tree counters so far (server-wide for the process: take differences around a run)."""
        if self.in_process:
            return {}
        with grpc.insecure_channel(self.proc.address) as ch:
            s = pb_grpc.DraftServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=10)
        return {"rounds": s.rounds, "tree_rounds": s.tree_rounds, "tree_nodes": s.tree_nodes,
                "tree_expand_s": s.tree_expand_s}

    @staticmethod
    def release(proposer) -> None:
        if isinstance(proposer, RemoteProposer):
            proposer.close()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
