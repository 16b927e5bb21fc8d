"""The DraftService servicer: the communication half.

Thin by design: it validates what arrives, turns protobuf into domain work
for the one global queue, and turns answers back into protobuf. One reader
task per stream pushes rounds; replies come back from the compute thread
through the event loop and the stream's own writer (this generator).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import grpc

from draft_server.config import DraftServerConfig
from draft_server.sessions import AdmissionRefused, Session, SessionTable, UnknownTag
from draft_server.stats import ServerStats
from draft_server.work_queue import ReleaseWork, RoundWork, WorkQueue
from starjar.proposer import DraftRequest
from starjar.security import caller_identity
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
# A start past any sequence's length: the draft engine answers resync and keeps no state for it.
RESYNC_START = 1 << 62

TAG_METADATA = "starjar-tag"
REASON_METADATA = "starjar-reason"
MAX_WORKER_ID = 64


class BadRequest(Exception):
    """Ends a stream with `code`; `reason` (machine-readable) travels as starjar-reason trailing metadata."""

    def __init__(self, code: grpc.StatusCode, field: str, limit: str, value=None, reason: str = ""):
        shown = "" if value is None else f" (got {value})"
        super().__init__(f"{field}: {limit}{shown}")
        self.code = code
        self.reason = reason


class DraftService(pb_grpc.DraftServiceServicer):
    def __init__(self, cfg: DraftServerConfig, sessions: SessionTable, queue: WorkQueue, stats: ServerStats,
                 fingerprint: tuple[int, str], draft_name: str, vocab_size: int):
        self.cfg = cfg
        self.sessions = sessions
        self.queue = queue
        self.stats = stats
        self.fingerprint = fingerprint
        self.draft_name = draft_name
        self.vocab_size = vocab_size
        self.draining = False
        self.faults = None  # draft_server.faults.Faults, set by the server (chaos tests)
        self.refusals: Counter[str] = Counter()  # refused Attach calls by reason (exported as a metric)
        self._streams: set[asyncio.Queue] = set()

    # ---- Attach ---------------------------------------------------------------------------

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        if self.faults is not None and self.faults.refuse_attach():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fault injection: refusing")
        if self.draining:
            self.refusals["draining"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draft server is shutting down")
        if not request.worker_id or len(request.worker_id) > MAX_WORKER_ID:
            self.refusals["invalid"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"worker_id: must be 1 to {MAX_WORKER_ID} characters")
        fp = (request.fingerprint.vocab_size, request.fingerprint.tokenizer_hash)
        if fp != self.fingerprint:
            self.refusals["fingerprint"] += 1
            context.set_trailing_metadata(((REASON_METADATA, "fingerprint"),))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"fingerprint: the target's tokenizer must equal the draft's "
                                f"(vocab_size {self.fingerprint[0]}, tokenizer_hash {self.fingerprint[1]})")
        try:
            s = self.sessions.attach(request.worker_id, caller_identity(context))
        except AdmissionRefused as exc:
            self.refusals[exc.reason] += 1
            context.set_trailing_metadata(((REASON_METADATA, exc.reason),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"reason={exc.reason}: {exc}")
        log.info("attached worker %s (%d/%d targets)", s.worker_id, len(self.sessions), self.sessions.max_targets)
        c = self.cfg
        return pb.AttachResponse(tag=s.tag, draft_model=self.draft_name, limits=pb.Limits(
            max_sequences=c.max_sequences_per_target, max_tokens_per_sequence=c.max_tokens_per_sequence,
            max_gamma=c.max_gamma, max_message_bytes=c.max_message_bytes, lease_seconds=c.lease_s))

    # ---- Speculate ------------------------------------------------------------------------

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):
        tag = _tag_from_metadata(context)
        try:
            session = self.sessions.open_stream(tag, caller_identity(context))
        except UnknownTag:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown tag")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        self._streams.add(out)
        inflight = 0
        room = asyncio.Event()  # set while fewer than max_rounds_in_flight rounds are in flight
        room.set()
        reader_done = False
        session.last_round_s = time.monotonic()
        ended = {"detached": (grpc.StatusCode.NOT_FOUND, "session", "detached by Release"),
                 "idle": (grpc.StatusCode.UNAVAILABLE, "stream", f"no round for {self.cfg.stream_idle_s:g} s")}
        session.end_stream = lambda why: out.put_nowait(BadRequest(*ended[why], reason=why))

        def reply(work: RoundWork, replies, wait_s, compute_s, batched):
            resp = pb.SpeculateResponse(round_id=work.round_id, timings=pb.RoundTimings(
                queue_wait_s=wait_s, compute_s=compute_s, batched_rounds=batched))
            for req, r in zip(work.requests, replies):
                d = resp.sequences.add(seq_id=req.seq_id[1])
                if r is None:
                    d.resync = True
                else:
                    d.tokens.extend(r)
            loop.call_soon_threadsafe(out.put_nowait, resp)

        async def read():
            nonlocal inflight, reader_done
            c = self.cfg
            try:
                requests = request_iterator.__aiter__()
                while True:
                    # At most max_rounds_in_flight rounds per stream: past it this stream is not read, and
                    # HTTP/2 flow control holds the target back.
                    await room.wait()
                    try:
                        request = await requests.__anext__()
                    except StopAsyncIteration:
                        break
                    if session.detached:
                        return
                    if self.draining:
                        raise BadRequest(grpc.StatusCode.UNAVAILABLE, "stream", "draft server is shutting down",
                                         reason="draining")
                    if len(self.queue) >= c.max_queued_rounds:
                        self.stats.queue_full += 1
                        raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue",
                                         f"{c.max_queued_rounds} rounds waiting", reason="queue_full")
                    work = self._round(session, request, reply)
                    inflight += 1
                    if inflight >= c.max_rounds_in_flight:
                        room.clear()
                    self.queue.put(work)
            except BadRequest as exc:
                out.put_nowait(exc)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken client stream ends only this stream
                log.debug("stream of %s ended: %s", session.worker_id, exc)
            reader_done = True
            out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await out.get()
                if isinstance(item, BadRequest):
                    if item.reason:
                        context.set_trailing_metadata(((REASON_METADATA, item.reason),))
                    await context.abort(item.code, str(item))
                if item is None:  # reader finished (or draining): end once replies are out
                    if inflight == 0:
                        return
                    continue
                inflight -= 1
                room.set()
                yield item
                if reader_done and inflight == 0:
                    return
                if self.draining and inflight == 0:
                    return
        finally:
            reader.cancel()
            session.end_stream = None
            self._streams.discard(out)
            self._detach(session)

    def _round(self, session: Session, request: pb.SpeculateRequest, reply) -> RoundWork:
        c = self.cfg
        seqs = request.sequences
        if len(seqs) > c.max_sequences_per_target:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "sequences",
                             f"at most {c.max_sequences_per_target} per round", len(seqs))
        seen = set()
        reqs = []
        now = time.monotonic()
        for i, s in enumerate(seqs):
            f = f"sequences[{i}]"
            if s.seq_id in seen:
                raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{f}.seq_id", "must be unique in a round",
                                 s.seq_id)
            seen.add(s.seq_id)
            bad = self._sequence_problem(session, s)
            if bad:  # this sequence is answered resync; the stream and the other sequences go on
                log.debug("round of %s: %s %s; resync", session.worker_id, f, bad)
                self.stats.bad_sequences += 1
                reqs.append(DraftRequest((session.tag, s.seq_id), RESYNC_START, [], 0))
                continue
            session.seq_last_used[s.seq_id] = now
            reqs.append(DraftRequest((session.tag, s.seq_id), s.start, list(s.tokens), s.gamma))
        session.rounds += 1
        session.last_round_s = now
        return RoundWork(session.tag, session.worker_id, request.round_id, reqs, reply)

    def _sequence_problem(self, session: Session, s) -> str | None:
        """Why one sequence of a round cannot be drafted (its limits), or None."""
        c = self.cfg
        if s.gamma > c.max_gamma:
            return f"gamma {s.gamma} > {c.max_gamma}"
        if s.start + len(s.tokens) > c.max_tokens_per_sequence:
            return f"start + len(tokens) {s.start + len(s.tokens)} > {c.max_tokens_per_sequence}"
        if s.tokens and max(s.tokens) >= self.vocab_size:
            return f"token id {max(s.tokens)} >= vocabulary {self.vocab_size}"
        if s.seq_id not in session.seq_last_used and len(session.seq_last_used) >= c.max_sequences_per_target:
            return f"more than {c.max_sequences_per_target} live sequences"
        return None

    # ---- Release --------------------------------------------------------------------------

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        try:
            session = self.sessions.get(bytes(request.tag), caller_identity(context))
        except UnknownTag:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown tag")
        if len(request.seq_ids) > self.cfg.max_sequences_per_target:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"seq_ids: at most {self.cfg.max_sequences_per_target}")
        if request.detach:
            return pb.ReleaseResponse(released=self._detach(session))
        ids = [q for q in request.seq_ids if session.seq_last_used.pop(q, None) is not None]
        if ids:
            self.queue.put(ReleaseWork([(session.tag, q) for q in ids]))
        return pb.ReleaseResponse(released=len(ids))

    def _detach(self, session: Session, why: str = "detached") -> int:
        """Free a session's sequences and slot, and end its stream if one is open (on the event loop)."""
        if self.sessions.detach(session.tag) is None:
            return 0
        if session.end_stream is not None:
            session.end_stream(why)
        ids = list(session.seq_last_used)
        session.seq_last_used.clear()
        # The engine applies this release after the tag's rounds in flight (it waits for their jobs).
        if ids:
            self.queue.put(ReleaseWork([(session.tag, q) for q in ids]))
        if not any(s.worker_id == session.worker_id for s in self.sessions.sessions()):
            self.stats.forget_worker(session.worker_id)
        log.info("detached worker %s (%s; %d sequences freed)", session.worker_id, why, len(ids))
        return len(ids)

    # ---- housekeeping ---------------------------------------------------------------------

    def reclaim_expired(self) -> int:
        """Run on the event loop (it may end streams)."""
        for s in self.sessions.idle_streams(self.cfg.stream_idle_s):
            self._detach(s, "idle")
        tags, seqs = self.sessions.expired(self.cfg.lease_s)
        n = 0
        for tag in tags:
            try:
                n += self._detach(self.sessions.get(tag), "lease expired")
            except UnknownTag:
                continue
        by_tag: dict[bytes, list[int]] = {}
        for tag, q in seqs:
            by_tag.setdefault(tag, []).append(q)
        for tag, ids in by_tag.items():
            try:
                s = self.sessions.get(tag)
            except UnknownTag:
                continue
            for q in ids:
                s.seq_last_used.pop(q, None)
            self.queue.put(ReleaseWork([(tag, q) for q in ids]))
            n += len(ids)
        self.stats.reclaimed_sequences += n
        if n:
            log.info("lease expired: reclaimed %d sequences", n)
        return n

    def start_draining(self) -> None:
        self.draining = True
        for q in list(self._streams):
            q.put_nowait(None)

    # ---- GetStats -------------------------------------------------------------------------

    async def GetStats(self, request, context) -> pb.DraftStats:
        snap = self.stats.snapshot()
        sessions = self.sessions.sessions()
        msg = pb.DraftStats(
            attached_targets=len(sessions), live_sequences=sum(len(s.seq_last_used) for s in sessions),
            queue_depth=len(self.queue), mode=self.cfg.mode, rounds=snap["rounds"], batches=snap["batches"],
            drafted_tokens=snap["drafted_tokens"], draft_steps=snap["draft_steps"],
            mean_step_s=snap["mean_step_s"], mean_service_s=snap["mean_service_s"],
            mean_wait_s=snap["mean_wait_s"], mean_idle_s=snap["mean_idle_s"], load=snap["load"],
            rounds_per_s=snap["rounds_per_s"], uptime_s=snap["uptime_s"],
            refused_admission=self.sessions.refused_admission, reclaimed_sequences=snap["reclaimed_sequences"],
            max_targets=self.sessions.max_targets, busy_s=snap["busy_s"], idle_s=snap["idle_s"])
        for worker, (n, rate) in sorted(snap["per_worker"].items()):
            msg.targets.add(worker_id=worker, rounds=n, rounds_per_s=rate)
        return msg


def _tag_from_metadata(context) -> bytes:
    for key, value in context.invocation_metadata() or ():
        if key == TAG_METADATA:
            try:
                return bytes.fromhex(value)
            except ValueError:
                return b""
    return b""
