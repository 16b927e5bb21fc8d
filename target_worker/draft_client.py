"""The remote proposer: a target worker's client of the draft service.

The engine calls `propose()` synchronously once per speculative step. Every
failure (refused at admission, not attached yet, a missed deadline, a broken
stream, a malformed reply) raises `DraftUnavailable`, which the engine turns into a speculation-free
step; sequences answered with `resync` are resent from position 0 next time. Meanwhile a background
thread reattaches with exponential backoff. Nothing here can fail or change a request.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import grpc

from starjar.errors import StarjarError
from starjar.proposer import DraftReply, DraftRequest
from starjar.security import Security
from starjar.token_tree import TokenTree
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from target_worker.breaker import Breaker
from target_worker.prefill_rounds import PrefillRounds

log = logging.getLogger(__name__)
TAG_METADATA = "starjar-tag"
HISTORY = 100_000
_CLOSE = object()


MAX_OUTSTANDING = 2  # rounds a stream may have unanswered (the server reads no more than this either)


class DraftUnavailable(RuntimeError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class ClientStats:
    rounds: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # reason -> steps without drafts
    attaches: int = 0
    refusals: Counter = field(default_factory=Counter)  # reason -> refused Attach calls
    # The last rounds' timings (bounded: a worker runs for weeks; metrics keep the long view).
    round_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # as seen by the target
    server_queue_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    server_compute_s: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    def wire_overhead_s(self) -> list[float]:
        return [r - q - c for r, q, c in zip(self.round_s, self.server_queue_s, self.server_compute_s, strict=True)]


class RemoteProposer:
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
        self._resolve = address if callable(address) else None
        self.address = "" if callable(address) else address
        self.worker_id = worker_id
        self.deadline_s = deadline_s
        vocab, tok_hash = fingerprint.split(":", 1)
        self._fingerprint = pb.ModelFingerprint(vocab_size=int(vocab), tokenizer_hash=tok_hash)
        self._backoff = backoff_s
        self._max_message_bytes = max_message_bytes
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.DraftServiceStub | None = None
        if self.address:
            self._connect(self.address)
        self._lock = threading.Lock()
        self._attached = threading.Event()
        self.attached_at: float | None = None  # wall time of the last attach (when speculation resumed)
        self._closed = False
        self._tag: bytes | None = None
        self.limits: pb.Limits | None = None
        self._requests: queue.Queue | None = None
        self._replies: queue.Queue = queue.Queue()
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
        if not self._attached.is_set():
            raise self._no_drafts("detached")
        with self._lock:
            reqs_q, limits = self._requests, self.limits
        if reqs_q is None:
            raise self._no_drafts("detached")
        sent, index = self._within_limits(requests, limits)  # index[k]: which request sent[k] stands for
        if not sent:
            return [None for _ in requests]
        if not self.breaker.allow():
            raise self._no_drafts("breaker_open")
        self._drop_late_replies()
        if self._prefills.in_flight:  # it would queue behind a prompt the server is still prefilling
            raise self._no_drafts("draft_prefill", "a prompt's prefill is unanswered")
        if len(self._outstanding) >= MAX_OUTSTANDING:  # the server has not answered the last ones: no more
            self.breaker.missed()
            raise self._no_drafts("backlog", f"{len(self._outstanding)} rounds unanswered")
        round_id = next(self._round_ids)
        msg = pb.SpeculateRequest(round_id=round_id)
        wire = []
        for r in sent:
            wid = self._wire_ids.get(r.seq_id)
            if wid is None:
                wid = self._wire_ids[r.seq_id] = next(self._next_wire_id)
            wire.append(wid)
            msg.sequences.add(seq_id=wid, start=r.start, tokens=r.tokens, gamma=r.gamma, tree_width=r.tree_width)
        t0 = time.perf_counter()
        self._outstanding.add(round_id)
        prompt = self._prefills.sent(round_id, sent)
        reqs_q.put(msg)
        if self._prefills.wont_make_it(prompt):  # sent, so the draft starts on it; nobody waits for it
            raise self._no_drafts("draft_prefill", f"{prompt} prompt tokens")
        resp = self._await_reply(round_id, t0 + self.deadline_s)
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
        # A sequence held back by the limits gets None: the server never saw these tokens, so the engine must
        # not count them as sent (it resends from position 0 when the sequence fits again).
        out: list[DraftReply] = [None for _ in requests]
        for s, r, i in zip(resp.sequences, sent, index, strict=True):
            if s.resync:
                self.stats.fallbacks["resync"] += 1
                out[i] = None
            else:
                out[i] = reply_of(s, r.gamma)
        return out

    def _within_limits(self, requests: Sequence[DraftRequest], limits) -> tuple[list[DraftRequest], list[int]]:
        """The server's advertised limits, applied here (a round past them would be answered resync): gamma
        clamped, sequences over the token limit or past the per-round count held back. Returns the requests to
        send and, for each, its index in `requests`."""
        sent, index = [], []
        for i, r in enumerate(requests):
            if limits is not None:
                too_long = (limits.max_tokens_per_sequence
                            and r.start + len(r.tokens) > limits.max_tokens_per_sequence)
                if too_long or (limits.max_sequences and len(sent) >= limits.max_sequences):
                    self.stats.fallbacks["over_limit"] += 1
                    continue
                if limits.max_gamma and r.gamma > limits.max_gamma:
                    r = DraftRequest(r.seq_id, r.start, r.tokens, limits.max_gamma, r.tree_width)
                if r.tree_width > max(1, limits.max_tree_width):  # an older server: chains only
                    r = DraftRequest(r.seq_id, r.start, r.tokens, r.gamma, limits.max_tree_width)
            sent.append(r)
            index.append(i)
        return sent, index

    def release(self, seq_ids: Sequence[Hashable]) -> None:
        self._prefills.release(seq_ids)
        wire = [w for w in (self._wire_ids.pop(s, None) for s in seq_ids) if w is not None]
        tag = self._tag
        if not wire or tag is None or not self._attached.is_set() or self._stub is None:
            return  # the server frees them with the stream or the lease
        fut = self._stub.Release.future(pb.ReleaseRequest(tag=tag, seq_ids=wire), timeout=2.0,
                                        metadata=self._auth)
        fut.add_done_callback(lambda f: f.exception() and log.debug("release failed: %s", f.exception()))

    def follow(self) -> None:
        """Leave the current draft server and ask the resolver where to attach (the controller moved this
        target to another one). Steps until the new stream is up decode without drafts; the old server frees
        this target's sequences with the stream it loses."""
        if self._resolve is None:
            return
        tag, stub = self._tag, self._stub
        self._drop_stream()
        if tag is not None and stub is not None:
            fut = stub.Release.future(pb.ReleaseRequest(tag=tag, detach=True), timeout=2.0, metadata=self._auth)
            fut.add_done_callback(lambda f: f.exception() and log.debug("detach failed: %s", f.exception()))
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        tag = self._tag
        self._drop_stream()
        if self._channel is None:
            return
        if tag is not None:
            try:
                self._stub.Release(pb.ReleaseRequest(tag=tag, detach=True), timeout=1.0, metadata=self._auth)
            except grpc.RpcError:
                pass
        self._channel.close()

    # ---- internals ------------------------------------------------------------------------

    def _connect(self, address: str) -> None:
        old = self._channel
        self._channel = self.security.channel(address, options=[
            ("grpc.max_send_message_length", self._max_message_bytes),
            ("grpc.max_receive_message_length", self._max_message_bytes),
            # Reconnect soon after a draft server restarts (gRPC's default backoff grows to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(self._backoff[1] * 1000)),
            # A hung or vanished server: an unanswered ping breaks the stream instead of TCP staying open.
            ("grpc.keepalive_time_ms", int(self._keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self._keepalive_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(self._keepalive_s * 1000)),  # what newer cores time pings by
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)])
        self._stub = pb_grpc.DraftServiceStub(self._channel)
        self.address = address
        if old is not None:
            old.close()

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
            self._connect(address)
        return self._stub is not None

    def _no_drafts(self, reason: str, detail: str = "") -> DraftUnavailable:
        """Count a step without drafts by reason, and hand back the error to raise (the engine then decodes
        that step alone)."""
        self.stats.fallbacks[reason] += 1
        return DraftUnavailable(reason, detail)

    def _drop_late_replies(self) -> None:
        """Answers to rounds given up on are no longer outstanding (read only by _await_reply before, they kept
        every breaker probe failing as a backlog: the stream never drafted again)."""
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

    def _await_reply(self, round_id: int, deadline: float) -> pb.SpeculateResponse:
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                if not self._prefills.is_prefill(round_id):  # a prompt's prefill is the server busy, not failing
                    self.breaker.missed()
                raise self._no_drafts("deadline", f"no drafts within {self.deadline_s * 1000:.0f} ms")
            try:
                resp = self._replies.get(timeout=left)
            except queue.Empty:
                continue
            if resp is _CLOSE:
                raise self._no_drafts("stream_broken")
            self._outstanding.discard(resp.round_id)
            self._prefills.answered(resp.round_id, resp)
            if resp.round_id == round_id:  # else a late answer to a round given up on: dropped
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
                resp = self._stub.Attach(pb.AttachRequest(worker_id=self.worker_id, fingerprint=self._fingerprint,
                                                            no_training=self.no_training),
                                         metadata=self._auth,
                                         timeout=5.0)
                self._open_stream(resp)
                self.stats.attaches += 1
                delay = self._backoff[0]
                log.info("attached to draft server %s", self.address)
                continue
            except grpc.RpcError as exc:
                reason = _reason(exc)
                self.stats.refusals[reason] += 1
                log.info("draft server %s: %s (%s); retrying in %.2fs", self.address, exc.code().name, reason,
                         delay)
            self._pause(delay)
            delay = min(self._backoff[1], delay * 2)

    def _pause(self, delay: float) -> None:
        """The backoff between attach tries, cut short by follow() (a new assignment is known now)."""
        if self._wake.wait(delay * (0.5 + random.random())):
            self._wake.clear()

    def _open_stream(self, resp: pb.AttachResponse) -> None:
        requests: queue.Queue = queue.Queue()

        def gen():
            while True:
                item = requests.get()
                if item is _CLOSE:
                    return
                yield item

        stream = self._stub.Speculate(gen(), metadata=((TAG_METADATA, resp.tag.hex()), *self._auth))
        with self._lock:
            self._tag, self.limits, self._requests = resp.tag, resp.limits, requests
        while not self._replies.empty():  # a stale close marker from the previous stream
            self._replies.get_nowait()
        self._outstanding.clear()
        self._prefills.forget()
        self._wire_ids.clear()  # a new tag knows no sequence: ids restart, the server asks for resyncs
        threading.Thread(target=self._read, args=(stream, requests), name="draft-reader", daemon=True).start()
        self.attached_at = time.time()
        self._attached.set()

    def _read(self, stream, requests: queue.Queue) -> None:
        try:
            for resp in stream:
                self._replies.put(resp)
            log.info("draft stream ended by the server")
        except grpc.RpcError as exc:
            if not self._closed:
                log.info("draft stream broken: %s", exc.code().name)
        with self._lock:
            if self._requests is requests:
                self._drop_stream_locked()
        self._replies.put(_CLOSE)
        self._wake.set()

    def _drop_stream(self) -> None:
        with self._lock:
            self._drop_stream_locked()

    def _drop_stream_locked(self) -> None:
        self._attached.clear()
        if self._requests is not None:
            self._requests.put(_CLOSE)
        self._requests, self._tag = None, None


def _reason(exc: grpc.RpcError) -> str:
    for key, value in (exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ():
        if key == "starjar-reason":
            return value
    return exc.code().name.lower() if hasattr(exc, "code") else "error"


def reply_of(seq_draft: pb.SequenceDraft, gamma: int) -> DraftReply:
    """One sequence's drafts from the wire: a chain (at most gamma tokens) or, with parents, a token tree
    (one the target cannot read, malformed, is no drafts this step)."""
    if not seq_draft.parents:
        return list(seq_draft.tokens)[:gamma]
    try:
        return TokenTree(tuple(seq_draft.tokens), tuple(seq_draft.parents), tuple(seq_draft.path_probs))
    except StarjarError:
        return []
