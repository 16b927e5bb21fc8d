"""Fuzzing a LIVE draft server with hypothesis.

Every RPC message (AttachRequest, SpeculateRequest, ReleaseRequest, GetStatsRequest) is generated from strategies
that reach the edges of each field (uint64 ids near 2^64, uint32 starts near 2^32, huge gammas and token ids,
empty and oversized repeated fields, arbitrary unicode, unknown fields) and sent over real gRPC on loopback to a
DraftServer with the tiny draft model. For each example an oracle computes what the server must answer; every
refusal must be INVALID_ARGUMENT naming the field (or NOT_FOUND for an unknown tag, RESOURCE_EXHAUSTED for
admission, FAILED_PRECONDITION for the fingerprint), never UNKNOWN or INTERNAL, and the server must stay healthy:
health SERVING, its compute thread alive, and a normal round still drafted after the fuzz.

A RuleBasedStateMachine then drives the session lifecycle (attach, speculate, release, detach, close the stream,
reconnect on a new channel) against the same kind of server, checking after every step that the server's
attached targets and live sequences equal the model's (attached <= N_max) and that a detach frees everything.

CI runs a small budget; `pytest -m chaos tests/draft_server/test_fuzz_draft.py` runs 2,000
examples per message and 200 runs x 50 steps.
"""

from __future__ import annotations

import queue
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from draft_server.background import BackgroundDraftServer
from draft_server.config import DraftServerConfig
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc

N_MAX = 4
MAX_SEQ = 4
MAX_GAMMA = 8
MAX_TOKENS = 256
CFG = DraftServerConfig(max_targets=N_MAX, max_sequences_per_target=MAX_SEQ, max_gamma=MAX_GAMMA,
                        max_tokens_per_sequence=MAX_TOKENS, lease_s=600.0)
HEALTH = "starjar.v1.DraftService"
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}

CI = dict(examples=100, runs=10, steps=20)
CHAOS = dict(examples=2000, runs=200, steps=50)
BUDGETS = [pytest.param(CI, id="ci"), pytest.param(CHAOS, id="chaos", marks=pytest.mark.chaos)]
SUPPRESS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large,
            HealthCheck.filter_too_much]


def fuzz_settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=SUPPRESS, database=None, derandomize=False)


# ---- strategies ---------------------------------------------------------------------------------

def _edgy(bits: int, small: int) -> st.SearchStrategy[int]:
    top = (1 << bits) - 1
    return st.one_of(st.integers(0, small), st.sampled_from([top, top - 1, 1 << (bits - 1), (1 << 31) - 1, 1 << 31]),
                     st.integers(0, top))


u64 = _edgy(64, 8)
u32 = _edgy(32, 300)
token = st.one_of(st.integers(0, 383), st.integers(0, 383), st.sampled_from([384, 385, 1 << 20, (1 << 32) - 1]),
                  st.integers(0, (1 << 32) - 1))
gamma = st.one_of(st.integers(0, MAX_GAMMA), st.integers(0, MAX_GAMMA), st.sampled_from([MAX_GAMMA + 1, 1 << 31]),
                  st.integers(0, (1 << 32) - 1))
start = st.one_of(st.just(0), st.just(0), st.integers(0, MAX_TOKENS + 5), u32)
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=80)

sequence_round = st.builds(
    pb.SequenceRound,
    seq_id=st.one_of(st.integers(0, 6), u64),  # small ids collide: duplicates in a round
    start=start,
    tokens=st.one_of(st.lists(token, max_size=12), st.lists(st.integers(0, 383), min_size=MAX_TOKENS - 4,
                                                            max_size=MAX_TOKENS + 20)),
    gamma=gamma,
    hidden_states=st.one_of(st.just(b""), st.binary(max_size=64)),
)
speculate_request = st.builds(pb.SpeculateRequest, round_id=u64,
                              sequences=st.lists(sequence_round, max_size=MAX_SEQ + 3))


def _unknown_fields() -> st.SearchStrategy[bytes]:
    """Well-formed protobuf bytes made only of field numbers the message does not define."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            b, n = n & 0x7F, n >> 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return bytes(out)

    def field(num, kind, value):
        if kind == 0:
            return varint(num << 3) + varint(value)
        return varint(num << 3 | 2) + varint(len(value)) + value

    one = st.builds(field, st.integers(1, 1 << 20), st.just(0), st.integers(0, (1 << 64) - 1)) | \
        st.builds(field, st.integers(1, 1 << 20), st.just(2), st.binary(max_size=40))
    return st.lists(one, max_size=8).map(b"".join)


# ---- the live server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(models):
    srv = BackgroundDraftServer(models["draft"], CFG).start()
    ch = grpc.insecure_channel(srv.address)
    yield srv, ch, pb_grpc.DraftServiceStub(ch)
    ch.close()
    srv.stop(grace=0.5)


def good_fingerprint(models) -> pb.ModelFingerprint:
    vocab, h = models["llama"].fingerprint.split(":", 1)
    return pb.ModelFingerprint(vocab_size=int(vocab), tokenizer_hash=h)


def wait_for(cond, timeout=10.0, what="condition"):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def stats(stub) -> pb.DraftStats:
    return stub.GetStats(pb.GetStatsRequest(), timeout=10)


def assert_refusal(err: grpc.RpcError, code: grpc.StatusCode, field: str) -> None:
    assert err.code() in ALLOWED, f"{err.code()}: {err.details()}"  # never UNKNOWN / INTERNAL
    assert err.code() == code, f"expected {code}, got {err.code()}: {err.details()}"
    assert field in (err.details() or ""), f"{err.details()!r} does not name {field!r}"


class RawStream:
    """One Speculate stream: put a round, take its answer (or the stream's error) with a timeout."""

    def __init__(self, stub, tag: bytes):
        self._q: queue.Queue = queue.Queue()
        self._call = stub.Speculate(iter(self._q.get, None), metadata=(("starjar-tag", tag.hex()),))

    def send(self, msg: pb.SpeculateRequest, timeout=30.0) -> pb.SpeculateResponse:
        self._q.put(msg)
        fut = next(self._call)  # raises grpc.RpcError if the server ended the stream
        return fut

    def close(self) -> None:
        self._q.put(None)
        try:
            for _ in self._call:  # drain: the server ends once its replies are out
                pass
        except grpc.RpcError:
            pass

    def cancel(self) -> None:
        self._call.cancel()


def assert_healthy(srv, ch, stub, models) -> None:
    """Health SERVING, the compute thread alive, and a normal round still drafted."""
    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=HEALTH), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert srv.server.compute.is_alive()
    vocab = srv.server.service.vocab_size
    tag = stub.Attach(pb.AttachRequest(worker_id="after-fuzz", fingerprint=good_fingerprint(models))).tag
    s = RawStream(stub, tag)
    r = s.send(pb.SpeculateRequest(round_id=7, sequences=[pb.SequenceRound(seq_id=1, start=0, tokens=[5, 17, 42],
                                                                             gamma=4)]))
    assert r.round_id == 7 and len(r.sequences[0].tokens) == 4 and not r.sequences[0].resync
    assert all(0 <= t < vocab for t in r.sequences[0].tokens)
    s.close()
    wait_for(lambda: stats(stub).attached_targets == 0 and stats(stub).live_sequences == 0, what="detach")
    wait_for(lambda: srv.server.compute.engine.num_sequences == 0, what="draft KV freed")


# ---- the oracle for one round -------------------------------------------------------------------

def expected_round(msg: pb.SpeculateRequest, vocab: int):
    """('refused', field) or ('answered', [per sequence: 'resync' | 'drafts' | 'any'])."""
    seqs = list(msg.sequences)
    if len(seqs) > MAX_SEQ:
        return "refused", "sequences"
    seen = set()
    for i, s in enumerate(seqs):
        if s.seq_id in seen:
            return "refused", f"sequences[{i}].seq_id"
        seen.add(s.seq_id)
    out = []
    live = 0
    for s in seqs:
        over = (s.gamma > MAX_GAMMA or s.start + len(s.tokens) > MAX_TOKENS
                or (s.tokens and max(s.tokens) >= vocab) or live >= MAX_SEQ)
        if over:
            out.append("resync")
            continue
        live += 1
        if s.start != 0:
            out.append("resync")  # a fresh session knows no prefix: position mismatch
        elif not s.tokens:
            out.append("any")  # nothing to draft from
        else:
            out.append("drafts")
    return "answered", out


# ---- one message at a time ----------------------------------------------------------------------

@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_attach(live, models, budget):
    srv, ch, stub = live
    good = good_fingerprint(models)
    fingerprint = st.one_of(st.just(good), st.just(None),
                            st.builds(pb.ModelFingerprint, vocab_size=u32, tokenizer_hash=text),
                            st.builds(pb.ModelFingerprint, vocab_size=st.just(good.vocab_size),
                                      tokenizer_hash=text))
    request = st.builds(lambda w, fp: pb.AttachRequest(worker_id=w, fingerprint=fp) if fp is not None
                        else pb.AttachRequest(worker_id=w), st.one_of(text, st.just(""), st.text(min_size=65,
                                                                                                 max_size=300)),
                        fingerprint)
    counts = {"ok": 0, "refused": 0}

    @fuzz_settings(budget["examples"])
    @given(request)
    def run(req):
        ok_id = 1 <= len(req.worker_id) <= 64
        ok_fp = req.HasField("fingerprint") and req.fingerprint == good
        try:
            resp = stub.Attach(req, timeout=10)
        except grpc.RpcError as err:
            counts["refused"] += 1
            if not ok_id:
                assert_refusal(err, grpc.StatusCode.INVALID_ARGUMENT, "worker_id")
            else:
                assert not ok_fp, f"a valid attach was refused: {err.code()} {err.details()}"
                assert_refusal(err, grpc.StatusCode.FAILED_PRECONDITION, "fingerprint")
                assert ("starjar-reason", "fingerprint") in err.trailing_metadata()
            return
        counts["ok"] += 1
        assert ok_id and ok_fp, f"accepted an attach it must refuse: {req}"
        assert len(resp.tag) == 16
        assert (resp.limits.max_gamma, resp.limits.max_sequences, resp.limits.max_tokens_per_sequence) == \
            (MAX_GAMMA, MAX_SEQ, MAX_TOKENS)
        assert stub.Release(pb.ReleaseRequest(tag=resp.tag, detach=True), timeout=10).released == 0

    run()
    assert counts["ok"] > 0 and counts["refused"] > 0  # both sides of the oracle were exercised
    assert stats(stub).attached_targets == 0
    assert_healthy(srv, ch, stub, models)


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_speculate(live, models, budget):
    srv, ch, stub = live
    vocab = srv.server.service.vocab_size
    good = good_fingerprint(models)
    counts = {"refused": 0, "answered": 0, "resync": 0, "drafted": 0}
    bad_before = srv.server.stats.bad_sequences

    @fuzz_settings(budget["examples"])
    @given(speculate_request)
    @example(pb.SpeculateRequest(round_id=1, sequences=[pb.SequenceRound(seq_id=1, start=0, tokens=[5, 6], gamma=2)]))
    def run(msg):  # the explicit example: a drafted round in every run, whatever the draw
        tag = stub.Attach(pb.AttachRequest(worker_id="fuzz", fingerprint=good), timeout=10).tag
        s = RawStream(stub, tag)
        kind, want = expected_round(msg, vocab)
        try:
            try:
                resp = s.send(msg)
            except grpc.RpcError as err:
                counts["refused"] += 1
                assert kind == "refused", f"round refused ({err.code()}: {err.details()}), expected an answer"
                assert_refusal(err, grpc.StatusCode.INVALID_ARGUMENT, want)
                return
            counts["answered"] += 1
            assert kind == "answered", f"expected a refusal naming {want}, got an answer"
            assert resp.round_id == msg.round_id
            assert [d.seq_id for d in resp.sequences] == [q.seq_id for q in msg.sequences]
            for d, q, w in zip(resp.sequences, msg.sequences, want, strict=True):
                assert len(d.tokens) <= min(q.gamma, MAX_GAMMA)
                assert all(0 <= t < vocab for t in d.tokens)
                if d.resync:
                    counts["resync"] += 1
                    assert not d.tokens and w != "drafts", f"resync for a valid sequence {q}"
                else:
                    assert w != "resync", f"drafts for a sequence over a limit or out of place: {q}"
                    if w == "drafts":
                        counts["drafted"] += 1
                        assert len(d.tokens) == q.gamma
        finally:
            s.close()

    run()
    assert counts["refused"] > 0 and counts["answered"] > 0 and counts["resync"] > 0 and counts["drafted"] > 0
    assert srv.server.stats.bad_sequences > bad_before  # over-limit sequences were counted, not crashed on
    assert_healthy(srv, ch, stub, models)


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_release(live, models, budget):
    srv, ch, stub = live
    good = good_fingerprint(models)
    request = st.tuples(
        st.sampled_from(["own", "random", "empty", "short", "long"]), st.binary(min_size=16, max_size=16),
        st.lists(st.one_of(st.integers(0, 5), u64), max_size=MAX_SEQ + 4), st.booleans(),
        st.lists(st.integers(0, 5), max_size=MAX_SEQ, unique=True))
    counts = {"ok": 0, "refused": 0}

    @fuzz_settings(budget["examples"])
    @given(request)
    def run(args):
        which, random_tag, seq_ids, detach, live_ids = args
        tag = stub.Attach(pb.AttachRequest(worker_id="fuzz-release", fingerprint=good), timeout=10).tag
        s = RawStream(stub, tag)
        try:
            if live_ids:
                r = s.send(pb.SpeculateRequest(round_id=1, sequences=[
                    pb.SequenceRound(seq_id=q, start=0, tokens=[3, 4, 5], gamma=1) for q in live_ids]))
                assert not any(d.resync for d in r.sequences)
            use = {"own": tag, "random": random_tag, "empty": b"", "short": tag[:8], "long": tag + b"\0"}[which]
            try:
                resp = stub.Release(pb.ReleaseRequest(tag=use, seq_ids=seq_ids, detach=detach), timeout=10)
            except grpc.RpcError as err:
                counts["refused"] += 1
                if use != tag:
                    assert_refusal(err, grpc.StatusCode.NOT_FOUND, "unknown tag")
                else:
                    assert len(seq_ids) > MAX_SEQ, f"a valid release was refused: {err.details()}"
                    assert_refusal(err, grpc.StatusCode.INVALID_ARGUMENT, "seq_ids")
                return
            counts["ok"] += 1
            assert use == tag and len(seq_ids) <= MAX_SEQ
            if detach:
                assert resp.released == len(live_ids)
            else:
                assert resp.released == len(set(seq_ids) & set(live_ids))
        finally:
            s.close()

    run()
    assert counts["ok"] > 0 and counts["refused"] > 0
    assert_healthy(srv, ch, stub, models)


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_get_stats(live, models, budget):
    """GetStatsRequest has no fields: fuzz it with unknown ones (well-formed bytes), while sessions come and go."""
    srv, ch, stub = live
    raw = ch.unary_unary("/starjar.v1.DraftService/GetStats", request_serializer=lambda b: b,
                         response_deserializer=pb.DraftStats.FromString)
    good = good_fingerprint(models)

    @fuzz_settings(budget["examples"])
    @given(_unknown_fields(), st.integers(0, N_MAX))
    def run(body, attached):
        tags = [stub.Attach(pb.AttachRequest(worker_id=f"s{i}", fingerprint=good), timeout=10).tag
                for i in range(attached)]
        try:
            got = raw(body, timeout=10)
            assert got.attached_targets == attached <= got.max_targets == N_MAX
            assert got.mode == "batched" and got.live_sequences == 0 and got.uptime_s > 0
            assert 0 <= got.load <= 1
        finally:
            for t in tags:
                stub.Release(pb.ReleaseRequest(tag=t, detach=True), timeout=10)

    run()
    assert_healthy(srv, ch, stub, models)


# ---- the session lifecycle ----------------------------------------------------------------------

class SessionMachine(RuleBasedStateMachine):
    """The model: per attached session its tag, its stream (or None) and its live sequences' lengths."""

    srv = ch = models = None  # set by the test before the machine runs

    @initialize()
    def setup(self):
        self.channels = [grpc.insecure_channel(self.srv.address)]
        self.sessions: dict[int, dict] = {}
        self.next_name = 0
        self.vocab = self.srv.server.service.vocab_size
        self.fp = good_fingerprint(self.models)

    @property
    def stub(self):
        return pb_grpc.DraftServiceStub(self.channels[-1])

    def _server_attached(self):
        return stats(pb_grpc.DraftServiceStub(self.ch)).attached_targets

    def _forget(self, name):
        self.sessions.pop(name)
        want = len(self.sessions)
        wait_for(lambda: self._server_attached() == want, what="server-side detach")

    @rule()
    def attach(self):
        full = len(self.sessions) >= N_MAX
        try:
            resp = self.stub.Attach(pb.AttachRequest(worker_id=f"m{self.next_name}", fingerprint=self.fp),
                                    timeout=10)
        except grpc.RpcError as err:
            assert full, f"attach refused with {len(self.sessions)} < N_max attached: {err.details()}"
            assert_refusal(err, grpc.StatusCode.RESOURCE_EXHAUSTED, "admission")
            assert ("starjar-reason", "admission") in err.trailing_metadata()
            return
        assert not full, "admitted past N_max"
        self.sessions[self.next_name] = dict(tag=resp.tag, stream=None, live={}, channel=self.channels[-1])
        self.next_name += 1

    def _pick(self, data, streaming=None):
        names = [n for n, s in self.sessions.items() if streaming is None or (s["stream"] is not None) == streaming]
        return data.draw(st.sampled_from(names)) if names else None

    @precondition(lambda self: any(s["stream"] is None for s in self.sessions.values()))
    @rule(data=st.data())
    def open_stream(self, data):
        name = self._pick(data, streaming=False)
        s = self.sessions[name]
        s["stream"] = RawStream(pb_grpc.DraftServiceStub(s["channel"]), s["tag"])

    @precondition(lambda self: any(s["stream"] is not None for s in self.sessions.values()))
    @rule(data=st.data(), ids=st.lists(st.integers(0, 6), min_size=1, max_size=MAX_SEQ, unique=True),
          g=st.integers(0, MAX_GAMMA))
    def speculate(self, data, ids, g):
        name = self._pick(data, streaming=True)
        s = self.sessions[name]
        seqs = []
        for q in ids:
            n = s["live"].get(q)
            if n is None:
                seqs.append(pb.SequenceRound(seq_id=q, start=0, tokens=[11, 12 + q, 13], gamma=g))
            else:
                seqs.append(pb.SequenceRound(seq_id=q, start=n, tokens=[20 + q], gamma=g))
        resp = s["stream"].send(pb.SpeculateRequest(round_id=self.next_name, sequences=seqs))
        assert [d.seq_id for d in resp.sequences] == ids
        for q, d, m in zip(ids, resp.sequences, seqs, strict=True):
            if q not in s["live"] and len(s["live"]) >= MAX_SEQ:
                assert d.resync and not d.tokens  # over the live-sequence limit: that one resyncs
                continue
            assert not d.resync, f"sequence {q} resynced, model says the server holds it"
            assert len(d.tokens) == g and all(0 <= t < self.vocab for t in d.tokens)
            s["live"][q] = m.start + len(m.tokens)

    @precondition(lambda self: bool(self.sessions))
    @rule(data=st.data(), ids=st.lists(st.integers(0, 6), max_size=MAX_SEQ))
    def release(self, data, ids):
        name = self._pick(data)
        s = self.sessions[name]
        got = self.stub.Release(pb.ReleaseRequest(tag=s["tag"], seq_ids=ids), timeout=10).released
        assert got == len(set(ids) & set(s["live"]))
        for q in ids:
            s["live"].pop(q, None)

    @precondition(lambda self: bool(self.sessions))
    @rule(data=st.data())
    def detach(self, data):
        name = self._pick(data)
        s = self.sessions[name]
        got = self.stub.Release(pb.ReleaseRequest(tag=s["tag"], detach=True), timeout=10).released
        assert got == len(s["live"])
        if s["stream"] is not None:  # a detach ends the stream: its next round is refused
            with pytest.raises(grpc.RpcError) as err:
                s["stream"].send(pb.SpeculateRequest(round_id=1, sequences=[]))
            assert err.value.code() in ALLOWED
            s["stream"].close()
        self._forget(name)
        # The tag is gone for good.
        with pytest.raises(grpc.RpcError) as err:
            self.stub.Release(pb.ReleaseRequest(tag=s["tag"]), timeout=10)
        assert_refusal(err.value, grpc.StatusCode.NOT_FOUND, "unknown tag")

    @precondition(lambda self: any(s["stream"] is not None for s in self.sessions.values()))
    @rule(data=st.data())
    def close_stream(self, data):
        """The target ends its stream: the server detaches the tag and frees its sequences."""
        name = self._pick(data, streaming=True)
        self.sessions[name]["stream"].close()
        self._forget(name)

    @rule()
    def reconnect(self):
        """The target's channel goes away (streams cancelled) and it comes back on a new one."""
        old = self.channels[-1]
        for name, s in list(self.sessions.items()):
            if s["channel"] is old and s["stream"] is not None:
                s["stream"].cancel()
                self._forget(name)
        old.close()
        self.channels.append(grpc.insecure_channel(self.srv.address))
        # Stream-less sessions of the old channel keep their tag (the lease reclaims them): still usable here.
        for s in self.sessions.values():
            if s["channel"] is old:
                s["channel"] = self.channels[-1]

    @invariant()
    def server_matches_model(self):
        if not hasattr(self, "sessions"):
            return
        st_ = stats(pb_grpc.DraftServiceStub(self.ch))
        assert st_.attached_targets == len(self.sessions) <= N_MAX
        assert st_.live_sequences == sum(len(s["live"]) for s in self.sessions.values())

    def teardown(self):
        for s in list(getattr(self, "sessions", {}).values()):
            if s["stream"] is not None:
                s["stream"].cancel()
            try:
                self.stub.Release(pb.ReleaseRequest(tag=s["tag"], detach=True), timeout=10)
            except grpc.RpcError:
                pass
        stub = pb_grpc.DraftServiceStub(self.ch)
        wait_for(lambda: stats(stub).attached_targets == 0 and stats(stub).live_sequences == 0,
                 what="everything detached")
        wait_for(lambda: self.srv.server.compute.engine.num_sequences == 0, what="draft KV freed after detach")
        for c in getattr(self, "channels", []):
            c.close()


@pytest.mark.parametrize("budget", BUDGETS)
def test_session_state_machine(live, models, budget):
    srv, ch, stub = live
    SessionMachine.srv, SessionMachine.ch, SessionMachine.models = srv, ch, models
    run_state_machine_as_test(SessionMachine, settings=settings(
        max_examples=budget["runs"], stateful_step_count=budget["steps"], deadline=None,
        suppress_health_check=SUPPRESS, database=None))
    assert_healthy(srv, ch, stub, models)
