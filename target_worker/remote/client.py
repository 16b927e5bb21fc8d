"""The remote proposer: a target worker's client of the draft service.

The engine calls `propose()` synchronously once per speculative step. Every failure (refused at admission, not
attached yet, a missed deadline, a broken stream, a malformed reply) raises `DraftUnavailable`, which the engine
turns into a speculation-free step; sequences answered with `resync` are resent from position 0 next time.
Meanwhile a background thread reattaches with exponential backoff. Nothing here can fail or change a request.
All gRPC runs on the proposer's own event loop (target_worker.remote.loop); replies come back on a queue.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import grpc

from starjar.cpu.kernels import compute_threads
from starjar.service.security import Security
from starjar.spec.proposer import DraftReply, DraftRequest
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from starjar.wire.keys import TAG_METADATA
from target_worker.prefill_rounds import PrefillRounds, likely_shares_cores
from target_worker.remote.breaker import Breaker
from target_worker.remote.client_stats import ClientStats
from target_worker.remote.loop import LOOP_ERRORS, SpeculateCall, WireLoop, channel_options, failure_reason, unary
from target_worker.remote.prompt_rounds import MAX_OUTSTANDING, PromptRounds
from target_worker.remote.round_codec import replies_of, round_request, within_limits
from target_worker.remote.staged import StagedDrafts

log = logging.getLogger(__name__)
_CLOSE = object()




class DraftUnavailable(RuntimeError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class RemoteProposer(PromptRounds):
    def __init__(self, address: str | Callable[[], str | None], fingerprint: str, worker_id: str,
                 deadline_s: float = 0.5, backoff_s: tuple[float, float] = (0.05, 1.0),
                 max_message_bytes: int = 4 << 20, breaker: Breaker | None = None,
                 keepalive_s: float = 10.0, security: Security | None = None, no_training: bool = False):
        """`address` is HOST:PORT, or a function returning the current one (None = unknown yet): under Ray
        a restarted draft server comes back on a new port, and the attach loop asks again before each try.
        `backoff_s` bounds the waits between attach tries (1 s at most: a restarted draft server is found
        again within about a second, at the price of one refused Attach a second while it is down).
        `breaker` stops proposing to a server that keeps missing deadlines; `keepalive_s` is how often the
        channel pings (a hung or vanished server breaks the stream within twice that). `no_training`: this
        target's verified tokens never feed the draft server's online adaptation (told at Attach)."""
        self.no_training = no_training
        self.breaker = breaker or Breaker()
        self.security = security or Security()  # the cluster token on every call; TLS when it has a CA
        self._auth = self.security.metadata()
        self._keepalive_s = keepalive_s
        self._outstanding: set[int] = set()  # rounds sent and not answered yet (at most MAX_OUTSTANDING)
        self._prefills = PrefillRounds(deadline_s)  # rounds that carry a prompt: a busy server, not a failing one
        self.staged = StagedDrafts()  # drafts the server pushed ahead (lookahead)
        self._resolve = address if callable(address) else None
        self.address = "" if callable(address) else address
        self.worker_id = worker_id
        self.deadline_s = deadline_s
        vocab, tok_hash = fingerprint.split(":", 1)
        self._fingerprint = pb.ModelFingerprint(vocab_size=int(vocab), tokenizer_hash=tok_hash)
        self._backoff = backoff_s
        self._max_message_bytes = max_message_bytes
        self._wire = WireLoop()  # owns the channel: every call below runs on it
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.DraftServiceStub | None = None
        if self.address:
            self._connect(self.address)
        self._lock = threading.Lock()
        self._attached = threading.Event()
        self.attached_at: float | None = None  # wall time of the last attach (when speculation resumed)
        self._closed = False
        self._tag: bytes | None = None
        self.limits: pb.Limits | None = None
        self._stream: SpeculateCall | None = None
        self._replies: queue.Queue = queue.Queue()  # filled by the loop: replies, and _CLOSE when a stream ends
        self._round_ids = itertools.count(1)
        self._wire_ids: dict[Hashable, int] = {}
        self._next_wire_id = itertools.count(1)
        self._wake = threading.Event()
        self.stats = ClientStats()
        self.on_round: Callable[[float, float, float], None] | None = None  # (round, server queue, compute) s
        self._attacher = threading.Thread(target=self._attach_loop, name="draft-attach", daemon=True)
        self._attacher.start()

    # ---- Proposer -------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._attached.is_set()

    def wait_attached(self, timeout: float) -> bool:
        return self._attached.wait(timeout)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftReply]:
        self._prefills.call_began(requests)
        kind = None
        try:
            replies = self._propose(requests)
            kind = "drafts" if any(r is not None for r in replies) else None
        except DraftUnavailable as exc:
            kind = "alone" if exc.reason == "draft_prefill" else None
            raise
        finally:
            self._prefills.call_ended(requests, kind)
        return replies

    def _propose(self, requests: Sequence[DraftRequest]) -> list[DraftReply]:
        if not self._attached.is_set():
            raise self._no_drafts("detached")
        with self._lock:
            stream, limits = self._stream, self.limits
        if stream is None:
            raise self._no_drafts("detached")
        sent, index = within_limits(requests, limits, self.stats.fallbacks)  # index[k]: what sent[k] stands for
        if not sent:
            return [None for _ in requests]
        if not self.breaker.allow():
            raise self._no_drafts("breaker_open")
        self._drop_late_replies()
        if self._prefills.in_flight and not self._await_prefills(self._prefills.in_flight_wait_s()):
            # It would queue behind a prompt the server is still prefilling: decode alone meanwhile.
            raise self._no_drafts("draft_prefill", "a prompt's prefill is unanswered")
        if len(self._outstanding) >= MAX_OUTSTANDING:  # the server has not answered the last ones: no more
            self.breaker.missed()
            raise self._no_drafts("backlog", f"{len(self._outstanding)} rounds unanswered")
        round_id = next(self._round_ids)
        msg = round_request(round_id, sent, self._wire_ids, self._next_wire_id.__next__)
        wire = [q.seq_id for q in msg.sequences]
        t0 = time.perf_counter()
        with self._lock:  # a stream that ended meanwhile would never answer: an orphan holding the next rounds
            if self._stream is not stream:
                raise self._no_drafts("detached")
            self._outstanding.add(round_id)
            prompt = self._prefills.sent(round_id, sent)
        stream.send(msg)
        ready = self.staged.replies(sent, wire) if len(sent) == len(requests) else None
        if ready is not None:  # every sequence's drafts were pushed ahead: no wait (its reply is dropped)
            return ready
        extra_s = 0.0
        if self._prefills.wont_make_it(prompt):
            extra_s = self._prefills.wait_s(prompt)  # where the draft shares our cores, waiting is faster
            if not extra_s:  # sent, so the draft starts on it; nobody waits for it
                raise self._no_drafts("draft_prefill", f"{prompt} prompt tokens")
        resp = self._await_reply(round_id, t0 + self.deadline_s + extra_s)
        self.breaker.answered()
        elapsed = time.perf_counter() - t0
        if len(resp.sequences) != len(wire) or any(s.seq_id != w for s, w in zip(resp.sequences, wire, strict=True)):
            raise self._no_drafts("malformed", f"round {round_id}")
        self.stats.rounds += 1
        self.stats.round_s.append(elapsed)
        self.stats.server_queue_s.append(resp.timings.queue_wait_s)
        self.stats.server_compute_s.append(resp.timings.compute_s)
        if self.on_round is not None:
            self.on_round(elapsed, resp.timings.queue_wait_s, resp.timings.compute_s)
        return replies_of(resp, sent, index, len(requests), self.stats.fallbacks)

    def release(self, seq_ids: Sequence[Hashable]) -> None:
        self._prefills.release(seq_ids)
        wire = [w for w in (self._wire_ids.pop(s, None) for s in seq_ids) if w is not None]
        self.staged.drop(wire)
        tag = self._tag
        if not wire or tag is None or not self._attached.is_set() or self._stub is None:
            return  # the server frees them with the stream or the lease
        release = pb.ReleaseRequest(tag=tag, seq_ids=wire)
        self._wire.in_background(unary(self._stub.Release, release, timeout=2.0, metadata=self._auth), "release")

    def follow(self) -> None:
        """Leave the current draft server and ask the resolver where to attach (the controller moved this
        target to another one). Steps until the new stream is up decode without drafts; the old server frees
        this target's sequences with the stream it loses."""
        if self._resolve is None:
            return
        tag, stub = self._tag, self._stub
        self._drop_stream()
        if tag is not None and stub is not None:
            detach = pb.ReleaseRequest(tag=tag, detach=True)
            self._wire.in_background(unary(stub.Release, detach, timeout=2.0, metadata=self._auth), "detach")
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        tag, stub, channel = self._tag, self._stub, self._channel
        self._drop_stream()
        if tag is not None and stub is not None:
            self._wire.try_call(unary(stub.Release, pb.ReleaseRequest(tag=tag, detach=True), timeout=1.0,
                                      metadata=self._auth), timeout=2.0)
        if channel is not None:
            self._wire.try_call(channel.close(), timeout=2.0)
        self._wire.close()

    # ---- internals ------------------------------------------------------------------------

    def _connect(self, address: str) -> None:
        """A channel to `address` on the loop (grpc.aio binds a channel to the loop it is made on)."""
        async def make() -> grpc.aio.Channel:
            return self.security.channel(address, aio=True, options=channel_options(
                self._max_message_bytes, self._backoff[1], self._keepalive_s))

        old = self._channel
        self._channel = self._wire.call(make(), timeout=5.0)
        self._stub = pb_grpc.DraftServiceStub(self._channel)
        self.address = address
        if old is not None:
            self._wire.spawn(old.close())

    def _follow_address(self) -> bool:
        """Before an attach try: move to the draft server's current address. False if none is known."""
        if self._resolve is None:
            return True
        try:
            address = self._resolve()
        except Exception as exc:  # the resolver is someone else's code (Ray): never let it kill the loop
            log.info("could not look up the draft server: %s", exc)
            address = None
        if address and address != self.address:
            log.info("draft server is now at %s", address)
            try:
                self._connect(address)
            except LOOP_ERRORS:  # closing: the attach loop ends
                return False
        return self._stub is not None

    def _no_drafts(self, reason: str, detail: str = "") -> DraftUnavailable:
        """Count a step without drafts by reason; the error to raise (the engine then decodes that step alone)."""
        self.stats.fallbacks[reason] += 1
        return DraftUnavailable(reason, detail)

    def _drop_late_replies(self) -> None:
        """Answers to rounds given up on (or sent ahead) are no longer outstanding: unread, they held rounds back."""
        while True:
            try:
                resp = self._replies.get_nowait()
            except queue.Empty:
                return
            if resp is _CLOSE:  # the stream broke: left for _await_reply to report
                self._replies.put(resp)
                return
            self._outstanding.discard(resp.round_id)
            self._prefills.answered(resp.round_id, resp)

    def _read_reply(self, timeout: float) -> pb.SpeculateResponse | None:
        """The next answer within timeout (None if none came), booked: no longer outstanding, what it tells of
        the server's prefills noted. A broken stream raises stream_broken."""
        try:
            resp = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if resp is _CLOSE:
            raise self._no_drafts("stream_broken")
        self._outstanding.discard(resp.round_id)
        self._prefills.answered(resp.round_id, resp)
        return resp

    def _await_prefills(self, wait_s: float) -> bool:
        """Read answers for up to wait_s until no prompt round is unanswered; whether none is."""
        until = time.perf_counter() + wait_s
        while self._prefills.in_flight:
            left = until - time.perf_counter()
            if left <= 0 or self._read_reply(left) is None:
                return False
        return True

    def _reply_by(self, round_id: int, deadline: float) -> pb.SpeculateResponse | None:
        """A round's answer by the deadline, without counting a step's fallback; None when none came or the
        stream broke."""
        try:
            while (left := deadline - time.perf_counter()) > 0:
                resp = self._read_reply(left)
                if resp is not None and resp.round_id == round_id:
                    return resp
        except DraftUnavailable:
            pass
        return None

    def _await_reply(self, round_id: int, deadline: float) -> pb.SpeculateResponse:
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                if not self._prefills.is_prefill(round_id):  # a prompt's prefill is the server busy, not failing
                    self.breaker.missed()
                raise self._no_drafts("deadline", f"no drafts within {self.deadline_s * 1000:.0f} ms")
            resp = self._read_reply(left)
            if resp is not None and resp.round_id == round_id:  # else a late answer to a round given up on
                return resp

    def _attach_loop(self) -> None:
        delay = self._backoff[0]
        while not self._closed:
            if self._attached.is_set():
                self._wake.wait()
                self._wake.clear()
                continue
            if not self._follow_address():
                self._pause(delay)
                delay = min(self._backoff[1], delay * 2)
                continue
            try:
                resp = self._wire.call(unary(self._stub.Attach, pb.AttachRequest(
                    worker_id=self.worker_id, fingerprint=self._fingerprint, no_training=self.no_training),
                    metadata=self._auth, timeout=5.0), timeout=6.0)
                if self._open_stream(resp):
                    self.stats.attaches += 1
                    delay = self._backoff[0]
                    log.info("attached to draft server %s", self.address)
                    continue
            except grpc.RpcError as exc:
                reason = failure_reason(exc)
                self.stats.refusals[reason] += 1
                log.info("draft server %s: %s (%s); retrying in %.2fs", self.address, exc.code().name, reason,
                         delay)
            except LOOP_ERRORS as exc:  # the proposer is closing, or the loop did not answer in time
                log.debug("attach to %s did not finish: %s", self.address, type(exc).__name__)
            self._pause(delay)
            delay = min(self._backoff[1], delay * 2)

    def _pause(self, delay: float) -> None:
        """The backoff between attach tries, cut short by follow() (a new assignment is known now)."""
        if self._wake.wait(delay * (0.5 + random.random())):
            self._wake.clear()

    def _open_stream(self, resp: pb.AttachResponse) -> bool:
        """Open the Speculate stream of a new tag; False if it ended before it could be used."""
        stream = SpeculateCall(self._wire, self._take_reply, self._stream_ended)
        shared = likely_shares_cores(self.address, compute_threads())  # may look up a name: not under the lock
        with self._lock:
            self._tag, self.limits, self._stream = resp.tag, resp.limits, stream
            while not self._replies.empty():  # a stale close marker from the previous stream
                self._replies.get_nowait()
            self._outstanding.clear()
            self._prefills.forget(shared)
            self._wire_ids.clear()  # a new tag knows no sequence: ids restart, the server asks for resyncs
            self.staged.clear()
        self._wire.call(stream.open(self._stub, ((TAG_METADATA, resp.tag.hex()), *self._auth)), timeout=5.0)
        with self._lock:
            if self._stream is not stream:  # it ended already (refused, or the server went away)
                return False
            self.attached_at = time.time()
            self._attached.set()
        return True

    def _take_reply(self, resp: pb.SpeculateResponse) -> None:
        """On the loop, each answer as it arrives: a push kept aside; a reply kept for the engine thread only if it
        answers a round in flight and the queue has room (a faulty server's unasked answers must not pile up)."""
        if resp.round_id == 0 and resp.staged:
            self.staged.take_push(resp)
        elif resp.round_id in self._outstanding and self._replies.qsize() <= MAX_OUTSTANDING:
            self._replies.put(resp)
        else:
            self.stats.unasked_replies += 1

    def _stream_ended(self, stream: SpeculateCall, error: BaseException | None) -> None:
        """On the loop, when a stream ends: steps fall back at once, the attach loop tries again."""
        if error is None:
            log.info("draft stream ended by the server")
        elif isinstance(error, grpc.RpcError) and not self._closed:
            log.info("draft stream broken: %s", error.code().name)
        with self._lock:
            current = self._stream is stream
            if current:
                self._drop_stream_locked()
        if current or self._stream is None:  # a round may wait on it (never told to a newer stream's rounds)
            self._replies.put(_CLOSE)
        self._wake.set()

    def _drop_stream(self) -> None:
        with self._lock:
            self._drop_stream_locked()

    def _drop_stream_locked(self) -> None:
        self._attached.clear()
        if self._stream is not None:
            self._stream.finish()
        self._stream, self._tag = None, None

