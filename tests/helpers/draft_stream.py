"""Raw streams of the draft service (no target worker in between): attach, send a round, read its answer."""

from __future__ import annotations

import contextlib
import queue
import time

import grpc

from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc


def fingerprint(model) -> pb.ModelFingerprint:
    """A loaded model's fingerprint as the Attach request carries it."""
    vocab, h = model.fingerprint.split(":", 1)
    return pb.ModelFingerprint(vocab_size=int(vocab), tokenizer_hash=h)


def attach(stub, models, worker="w"):
    """Attach as a target of the llama family; the reply holds the tag and the server's limits."""
    return stub.Attach(pb.AttachRequest(worker_id=worker, fingerprint=fingerprint(models["llama"])))


class Stream:
    """A raw Speculate stream: send a round, get its answer (pushes that come before it are kept in `pushes`)."""

    def __init__(self, stub, tag: bytes):
        self._q: queue.Queue = queue.Queue()
        self._responses = stub.Speculate(iter(self._q.get, None), metadata=(("starjar-tag", tag.hex()),))
        self._round = 0
        self.pushes: list = []

    def round(self, *seqs, timeout=30):
        self._round += 1
        self._q.put(pb.SpeculateRequest(round_id=self._round, sequences=[pb.SequenceRound(**s) for s in seqs]))
        while (resp := next(self._responses)).round_id == 0:
            self.pushes.append(resp)
        return resp

    def close(self):
        self._q.put(None)


def wait_until(cond, timeout=3.0):
    """Polls `cond` until it holds; asserts it once more when `timeout` seconds have passed."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.02)
    assert cond()


@contextlib.contextmanager
def served(models, draft, configs):
    """One BackgroundDraftServer per config serving `draft`, each with a raw stream attached: (servers,
    streams, stubs)."""
    from draft_server.background import BackgroundDraftServer

    servers = [BackgroundDraftServer(draft, c).start() for c in configs]
    channels = [grpc.insecure_channel(s.address) for s in servers]
    stubs = [pb_grpc.DraftServiceStub(ch) for ch in channels]
    streams = [Stream(stub, attach(stub, models).tag) for stub in stubs]
    try:
        yield servers, streams, stubs
    finally:
        for s, ch, srv in zip(streams, channels, servers, strict=True):
            s.close()
            ch.close()
            srv.stop(grace=0.5)
