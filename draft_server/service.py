"""The DraftService servicer: the communication half.

Thin by design: it checks what arrives (draft_server.round_check), turns
protobuf into domain work for the one global queue, and turns answers back
into protobuf; each Speculate stream is a SpeculateStream. It raises typed
errors (starjar.errors) and never aborts a call itself: the server's
ErrorStatus interceptor maps them to status codes in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import Counter

import grpc

from draft_server.config import DraftServerConfig
from draft_server.round_check import check_round
from draft_server.sessions import AdmissionRefused, Session, SessionTable, UnknownTag
from draft_server.speculate_stream import SpeculateStream
from draft_server.stats import ServerStats
from draft_server.tree_draft import fit_width
from draft_server.work_queue import ReleaseWork, RoundWork, WorkQueue
from starjar.errors import FailedPrecondition, InvalidArgument, NotServing, StarjarError
from starjar.service.security import caller_identity
from starjar.spec.proposer import DraftRequest
from starjar.v1 import draft_pb2 as pb
from starjar.v1 import draft_pb2_grpc as pb_grpc
from starjar.wire.keys import FINGERPRINT, REPLACED, TAG_METADATA, WORKER_ID

log = logging.getLogger(__name__)
# A start past any sequence's length: the draft engine answers resync and keeps no state for it.
RESYNC_START = 1 << 62

MAX_WORKER_ID = 64


class DraftService(pb_grpc.DraftServiceServicer):
    def __init__(self, cfg: DraftServerConfig, sessions: SessionTable, queue: WorkQueue, stats: ServerStats,
                 fingerprint: tuple[int, str], draft_name: str, vocab_size: int, faults=None):
        """faults: draft_server.faults.Faults (chaos tests; inert unless switched on)."""
        self.cfg = cfg
        self.sessions = sessions
        self.queue = queue
        self.stats = stats
        self.fingerprint = fingerprint
        self.draft_name = draft_name
        self.vocab_size = vocab_size
        self.draining = False
        self.faults = faults
        self.tide = None  # draft_server.tide.adaptation.Tide when adaptation is on (its counters go into GetStats)
        self.prompt_kv_from = ""  # Limits.prompt_kv_from: the weights whose prompt KV the draft takes ("": none)
        self.kv_token_bytes = 0  # one token's prompt_kv bytes (0: prompt_kv refused)
        self.refusals: Counter[str] = Counter()  # refused Attach calls by reason (exported as a metric)
        self._streams: set[SpeculateStream] = set()

    # ---- Attach ---------------------------------------------------------------------------

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        if self.faults is not None and self.faults.refuse_attach():
            raise NotServing("fault injection: refusing")
        if self.draining:
            raise self._refused("draining", NotServing("draft server is shutting down"))
        if not request.worker_id or len(request.worker_id) > MAX_WORKER_ID:
            raise self._refused("invalid", InvalidArgument(WORKER_ID, f"must be 1 to {MAX_WORKER_ID} characters"))
        fp = (request.fingerprint.vocab_size, request.fingerprint.tokenizer_hash)
        if fp != self.fingerprint:
            raise self._refused("fingerprint", FailedPrecondition(
                f"fingerprint: the target's tokenizer must equal the draft's (vocab_size {self.fingerprint[0]}, "
                f"tokenizer_hash {self.fingerprint[1]})", reason=FINGERPRINT))
        caller = caller_identity(context)
        try:
            s, old = self.sessions.attach(request.worker_id, caller, request.no_training)
        except AdmissionRefused as exc:
            raise self._refused(exc.reason, exc) from None
        if old is not None:  # the worker restarted (or attached again): its old session goes, KV and all
            self._free(old, REPLACED)
            if old.caller != caller:
                log.warning("worker %s attached from another caller: its old session was replaced", s.worker_id)
        self.stats.worker_attached(s.worker_id)
        log.info("attached worker %s (%d/%d targets)", s.worker_id, len(self.sessions), self.sessions.max_targets)
        c = self.cfg
        return pb.AttachResponse(tag=s.tag, draft_model=self.draft_name, limits=pb.Limits(
            max_sequences=c.max_sequences_per_target, max_tokens_per_sequence=c.max_tokens_per_sequence,
            max_gamma=c.max_gamma, max_message_bytes=c.max_message_bytes, lease_seconds=c.lease_s,
            max_tree_width=c.max_tree_width, max_tree_nodes=c.max_tree_nodes, prefills_ahead=c.lookahead != "off",
            prompt_kv_from=self.prompt_kv_from))

    def _refused(self, counted_as: str, exc: StarjarError) -> StarjarError:
        """Count a refused Attach by reason (a metric), and hand back the error to raise."""
        self.refusals[counted_as] += 1
        return exc

    # ---- Speculate ------------------------------------------------------------------------

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):
        session = self.sessions.open_stream(_tag_from_metadata(context), caller_identity(context))
        stream = SpeculateStream(self, session, request_iterator)
        self._streams.add(stream)
        session.last_round_s = time.monotonic()
        session.end_stream = stream.end
        reader = asyncio.create_task(stream.read())
        try:
            async for reply in stream.replies():
                yield reply
        finally:
            reader.cancel()
            session.end_stream = None
            self._streams.discard(stream)
            self._detach(session)

    def round_work(self, session: Session, request: pb.SpeculateRequest, deliver, push=None) -> RoundWork:
        """One checked round as work for the queue; records the session's live sequences and its last round.
        A sequence past a limit is sent as a resync request (the engine keeps no state for it)."""
        problems = check_round(request.sequences, self.cfg, self.vocab_size, session.seq_last_used.keys(),
                               self.kv_token_bytes)
        now = time.monotonic()
        reqs = []
        for i, (s, problem) in enumerate(zip(request.sequences, problems, strict=True)):
            if problem:
                log.debug("round of %s: sequences[%d] %s; resync", session.worker_id, i, problem)
                self.stats.bad_sequences += 1
                reqs.append(DraftRequest((session.tag, s.seq_id), RESYNC_START, [], 0))
                continue
            session.seq_last_used[s.seq_id] = now
            width = fit_width(s.gamma, s.tree_width, self.cfg.max_tree_nodes) if s.tree_width > 1 else 0
            # int32s, not a list of ints: a round in flight holds every sequence's tokens until it is answered
            # (measured: 25 MiB of lists for 8 rounds of 64 x 4000 tokens, 2.5x what the ints need).
            reqs.append(DraftRequest((session.tag, s.seq_id), s.start, array("i", s.tokens), s.gamma, width,
                                     s.prompt_kv))
        session.rounds += 1
        session.last_round_s = now
        return RoundWork(session.tag, session.worker_id, request.round_id, reqs, deliver,
                         train=not session.no_training, push=push)

    # ---- Release --------------------------------------------------------------------------

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        session = self.sessions.get(bytes(request.tag), caller_identity(context))
        if len(request.seq_ids) > self.cfg.max_sequences_per_target:
            raise InvalidArgument("seq_ids", f"at most {self.cfg.max_sequences_per_target}", len(request.seq_ids))
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
        return self._free(session, why)

    def _free(self, session: Session, why: str) -> int:
        """A session out of the table: end its stream, free its sequences; how many were freed."""
        if session.end_stream is not None:
            session.end_stream(why)
        ids = list(session.seq_last_used)
        session.seq_last_used.clear()
        # The engine applies this release after the tag's rounds in flight (it waits for their jobs).
        if ids:
            self.queue.put(ReleaseWork([(session.tag, q) for q in ids]))
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
        for stream in list(self._streams):
            stream.wake_to_drain()

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
            max_targets=self.sessions.max_targets, busy_s=snap["busy_s"], idle_s=snap["idle_s"],
            tree_rounds=snap["tree_rounds"], tree_nodes=snap["tree_nodes"], tree_expand_s=snap["tree_expand_s"],
            **{k: v for k, v in snap.items() if k.startswith("lookahead_")})
        for worker, (n, rate) in sorted(snap["per_worker"].items()):
            msg.targets.add(worker_id=worker, rounds=n, rounds_per_s=rate)
        if self.tide is not None:
            t = self.tide.snapshot()
            msg.tide_acceptance_short, msg.tide_acceptance_long = t["acceptance_short"], t["acceptance_long"]
            msg.tide_collecting, msg.tide_train_steps, msg.tide_swaps = t["collecting"], t["train_steps"], t["swaps"]
            msg.tide_train_s, msg.tide_heldout_acceptance = t["train_s"], t["heldout_acceptance"]
            msg.tide_buffered_sequences, msg.tide_buffered_tokens = t["buffered_sequences"], t["buffered_tokens"]
            msg.tide_cycles = t["cycles"]
        return msg


def _tag_from_metadata(context) -> bytes:
    for key, value in context.invocation_metadata() or ():
        if key == TAG_METADATA:
            try:
                return bytes.fromhex(value)
            except ValueError:
                return b""
    return b""
