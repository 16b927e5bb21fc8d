"""Corrupted draft replies into a target: 0 crashes, 0 altered outputs, each a step without drafts.

Two sources of corruption, both over real gRPC on loopback into a real TargetEngine + RemoteProposer:
  * the real DraftServer with its fault switch STARJAR_DRAFT_FAULTS=corrupt=1.0 (every reply carries more tokens
    than asked, all outside the vocabulary);
  * a fake DraftService servicer (fault injection only) answering every round with one kind of garbage: wrong
    round ids, wrong or missing or extra sequences, too many tokens, out-of-vocabulary and 2^32-1 ids, resync
    flags that carry tokens.
Greedy outputs must equal the `reference` fixture (HF generate), the engine must never raise, and the engine's
and proposer's counters must show that no corrupt reply was used as drafts.
CI runs ~150 corrupt replies from the real server and ~50 per garbage kind; `-m chaos` runs >= 1,000 each.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from fault_servers import wait_until

from draft_server.background import BackgroundDraftServer
from starjar.spec.policy import FixedGamma
from starjar.spec.sampling import SamplingParams
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.engine import EngineConfig, TargetEngine
from target_worker.remote.client import MAX_OUTSTANDING, RemoteProposer

MAX_NEW = 48
GREEDY = SamplingParams(max_tokens=MAX_NEW)
# (prompts, batch): steps ~= prompts / batch * MAX_NEW, one round (one reply) per decode step.
CI = dict(prompts=6, batch=2, repeat=1, min_replies=100)
CHAOS = dict(prompts=40, batch=2, repeat=2, min_replies=1000)
SIZES = [pytest.param(CI, id="ci"), pytest.param(CHAOS, id="chaos", marks=pytest.mark.chaos)]


def run_engine(models, address, prompts, batch, deadline_s=2.0):
    rp = RemoteProposer(address, models["llama"].fingerprint, "victim", deadline_s, backoff_s=(0.02, 0.2),
                        )
    eng = TargetEngine(models["llama"], rp, FixedGamma(4), EngineConfig(max_batch_size=batch))
    assert rp.wait_attached(10)
    try:
        reqs = eng.generate(prompts, GREEDY)  # raises if a corrupt reply crashes a step
    finally:
        rp.close()
    return [r.output_ids for r in reqs], eng.stats, rp.stats


@pytest.mark.parametrize("size", SIZES)
def test_fault_switch_corrupts_every_reply_and_no_output_changes(models, prompt_ids, reference, monkeypatch,
                                                                size):
    monkeypatch.setenv("STARJAR_DRAFT_FAULTS", "corrupt=1.0")  # read when the DraftServer is built
    ref = reference("llama", MAX_NEW)
    n = size["prompts"]
    with BackgroundDraftServer(models["draft"]) as srv:
        faults = srv.server.faults
        assert faults.active and faults.plan.corrupt == 1.0
        outs, es, cs = run_engine(models, srv.address, prompt_ids[:n] * size["repeat"], size["batch"])
        corrupted = faults.replies
    assert outs == ref[:n] * size["repeat"]  # altered = 0, lost = 0
    assert corrupted >= size["min_replies"], f"only {corrupted} corrupt replies"
    assert cs.rounds == corrupted  # every corrupt reply reached the target (none lost to a deadline)
    # Each became a step without drafts: no draft was ever verified, every asked-for step fell back.
    assert es.drafted_tokens == 0 and es.accepted_tokens == 0 and es.spec.steps == 0
    assert es.fallback.steps >= corrupted
    assert es.proposer_failures >= corrupted  # one per sequence with out-of-vocabulary drafts


class GarbageDraftService(pb_grpc.DraftServiceServicer):
    """Fault injection: a draft server answering every round with one kind of garbage."""

    def __init__(self, kind: str, vocab: int):
        self.kind, self.vocab = kind, vocab
        self.replies = 0
        self._lock = threading.Lock()

    def Attach(self, request, context):
        return pb.AttachResponse(tag=b"g" * 16, limits=pb.Limits(max_gamma=8, max_sequences=64,
                                                                 max_tokens_per_sequence=4096))

    def Release(self, request, context):
        return pb.ReleaseResponse(released=0)

    def Speculate(self, request_iterator, context):
        for req in request_iterator:
            for _ in range(FLOOD if self.kind == "flood" else 1):
                yield self._garbage(req)
                with self._lock:
                    self.replies += 1

    def _garbage(self, req: pb.SpeculateRequest) -> pb.SpeculateResponse:
        k, v = self.kind, self.vocab
        resp = pb.SpeculateResponse(round_id=req.round_id + 1 if k == "wrong_round" else req.round_id)
        for i, s in enumerate(req.sequences):
            good = [3] * s.gamma
            if k == "wrong_seq":
                resp.sequences.add(seq_id=s.seq_id + 1000, tokens=good)
            elif k == "missing_sequence" and i == len(req.sequences) - 1:
                continue
            elif k == "out_of_vocab":
                resp.sequences.add(seq_id=s.seq_id, tokens=[v + i for i in range(s.gamma)])
            elif k == "too_many_huge":
                resp.sequences.add(seq_id=s.seq_id, tokens=[0xFFFFFFFF] * (s.gamma + 50))
            elif k == "last_draft_out_of_vocab":  # all but the last in range: still unusable as a whole
                resp.sequences.add(seq_id=s.seq_id, tokens=good[:-1] + [v])
            elif k == "resync_with_tokens":
                resp.sequences.add(seq_id=s.seq_id, tokens=good, resync=True)
            else:
                resp.sequences.add(seq_id=s.seq_id, tokens=good)
        if k == "extra_sequence":
            resp.sequences.add(seq_id=123456789, tokens=[1, 2])
        return resp


FLOOD = 200  # "flood": every round answered this many times (a faulty server repeating itself)
KINDS = ["wrong_round", "wrong_seq", "missing_sequence", "extra_sequence", "out_of_vocab", "too_many_huge",
         "last_draft_out_of_vocab", "resync_with_tokens"]


@pytest.fixture()
def garbage_server(models):
    servers = []

    def start(kind):
        svc = GarbageDraftService(kind, models["llama"].vocab_size)
        # The targets ping every keepalive_s; allowed as the real draft server allows it (a default server
        # answers the third ping with GOAWAY too_many_pings, a stream break the test does not inject).
        server = grpc.server(futures.ThreadPoolExecutor(8), options=[
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000), ("grpc.http2.max_ping_strikes", 0)])
        pb_grpc.add_DraftServiceServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return svc, f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(0)


@pytest.mark.parametrize("size", [pytest.param(dict(prompts=2, batch=2, min_replies=40), id="ci"),
                                  pytest.param(dict(prompts=40, batch=2, min_replies=800), id="chaos",
                                               marks=pytest.mark.chaos)])
@pytest.mark.parametrize("kind", KINDS)
def test_garbage_replies_become_steps_without_drafts(models, prompt_ids, reference, garbage_server, kind, size):
    ref = reference("llama", MAX_NEW)
    n = size["prompts"]
    svc, address = garbage_server(kind)
    # wrong_round: every answer looks late and is dropped (a short deadline keeps that cheap); with its rounds
    # never answered the client stops sending past MAX_OUTSTANDING, so few replies are ever asked for.
    deadline = 0.05 if kind == "wrong_round" else 2.0
    outs, es, cs = run_engine(models, address, prompt_ids[:n], size["batch"], deadline_s=deadline)
    assert outs == ref[:n]  # altered = 0
    replies = svc.replies
    assert es.drafted_tokens == 0 and es.accepted_tokens == 0 and es.spec.steps == 0
    if kind == "wrong_round":
        assert replies >= 1 and cs.fallbacks["deadline"] >= 1 and cs.rounds == 0
        # A first round that carries a prompt holds the later ones back until it is answered (draft_prefill).
        assert es.fallback.steps >= 20 and cs.fallbacks["deadline"] + cs.fallbacks["backlog"] + \
            cs.fallbacks["breaker_open"] + cs.fallbacks["draft_prefill"] == es.proposer_failures
        return
    assert replies >= size["min_replies"], f"only {replies} garbage replies"
    assert es.fallback.steps >= replies - 2  # each reply (but the last in flight at the end) a step without drafts
    expected_reason = {"wrong_seq": "malformed", "missing_sequence": "malformed",
                       "extra_sequence": "malformed", "resync_with_tokens": "resync"}.get(kind)
    if expected_reason:
        assert cs.fallbacks[expected_reason] >= replies - 2, dict(cs.fallbacks)
    else:  # out-of-vocabulary drafts: refused by the engine, one failure per sequence
        assert es.proposer_failures >= replies


def test_a_server_flooding_answers_cannot_grow_the_targets_memory(models, prompt_ids, reference, garbage_server):
    """Every round answered 200 times: the repeats are dropped as they arrive (before, each was queued until a
    later step proposed, and nothing drains the queue while no step drafts). Outputs stay the target's."""
    svc, address = garbage_server("flood")
    rp = RemoteProposer(address, models["llama"].fingerprint, "flooded", 2.0, backoff_s=(0.02, 0.2))
    eng = TargetEngine(models["llama"], rp, FixedGamma(4), EngineConfig(max_batch_size=2))
    assert rp.wait_attached(10)
    try:
        outs = [r.output_ids for r in eng.generate(prompt_ids[:2], GREEDY)]
        assert wait_until(lambda: svc.replies >= FLOOD * rp.stats.rounds)  # the last round's repeats were sent
        time.sleep(0.5)  # and reached the target's stream reader
        queued = rp._replies.qsize()
    finally:
        rp.close()
    assert outs == reference("llama", MAX_NEW)[:2]
    # A repeat may be queued while its round is unread (the queue's room), every other one is dropped.
    assert rp.stats.rounds >= 10 and rp.stats.unasked_replies >= (FLOOD - 2 - MAX_OUTSTANDING) * rp.stats.rounds
    assert queued <= MAX_OUTSTANDING + 1, queued
