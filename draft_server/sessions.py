"""Attached targets and their tags.

A tag is 16 bytes from the OS CSPRNG: the only credential a target has. A tag
is bound to at most one open Speculate stream; when that stream ends the tag
is detached and its sequences freed. Tags attached but never streamed are
reclaimed after the lease. Lookups of unknown tags all fail the same way, so
a caller learns nothing about which tags exist.

A worker id holds at most one session: a new Attach with the id of an
attached session replaces it, so a restarted target, or one whose connection
broke without the server noticing, gets its slot back at once instead of
waiting for the lease or a keepalive timeout. Not when that session is
younger than reclaim_after_s (two live processes under one id would evict
each other as fast as they can attach), nor when another caller attaches
while the session is live (a round within reclaim_after_s): those are refused
with reason "worker_id". The replacement starts empty under a fresh tag and
the old tag stops working, so whoever attaches under a copied id gains
nothing of the old session: its sequences are freed, never handed over. Only
a caller the server authenticated reaches Attach at all.
Optionally each caller (starjar.service.security.caller_identity) holds at most
max_per_caller sessions, so one caller cannot take every slot.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starjar.errors import NotFound, ServerBusy
from starjar.wire.keys import ADMISSION, CALLER, WORKER_ID

TAG_BYTES = 16


class UnknownTag(NotFound, LookupError):
    """NOT_FOUND on the wire; deliberately carries no detail."""

    def __init__(self):
        super().__init__("unknown tag")


class AdmissionRefused(ServerBusy):
    """N_max targets are attached ("admission"), the caller holds its cap of sessions ("caller"), or the worker
    id's session is live ("worker_id") (RESOURCE_EXHAUSTED, the reason first in the message too)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"reason={reason}: {detail}", reason)


@dataclass
class Session:
    tag: bytes
    worker_id: str
    caller: str = ""  # who attached it (starjar.service.security.caller_identity): only they may use the tag
    attached_s: float = field(default_factory=time.monotonic)
    last_seen_s: float = field(default_factory=time.monotonic)
    streaming: bool = False
    rounds: int = 0
    seq_last_used: dict[int, float] = field(default_factory=dict)  # seq_id -> monotonic time
    last_round_s: float = field(default_factory=time.monotonic)
    detached: bool = False
    no_training: bool = False  # the target opted out of online adaptation at Attach
    # Set by the tag's open stream: ends it (a detach, or an idle stream) from the event loop.
    end_stream: Callable[[str], None] | None = None


class SessionTable:
    """Thread-safe: the gRPC loop and the compute thread both consult it."""

    def __init__(self, max_targets: int, max_per_caller: int | None = None, reclaim_after_s: float = 2.0):
        """max_per_caller: sessions one caller may hold (None: only N_max bounds them). reclaim_after_s: how old a
        session must be before an Attach of its worker id replaces it, and, for an Attach from another caller,
        how long it must have had no round."""
        self.max_targets = max_targets
        self.max_per_caller = max_per_caller
        self.reclaim_after_s = reclaim_after_s
        self._by_tag: dict[bytes, Session] = {}
        self._lock = threading.Lock()
        self.refused_admission = 0

    def attach(self, worker_id: str, caller: str = "", no_training: bool = False) -> tuple[Session, Session | None]:
        """A new session, and the session of the same worker id it replaced, if there was one (already out of the
        table and marked detached: the service frees its sequences and ends its stream)."""
        with self._lock:
            old = next((s for s in self._by_tag.values() if s.worker_id == worker_id), None)
            if old is not None:
                self._check_replaceable(old, caller)
            others = [s for s in self._by_tag.values() if s is not old]
            if len(others) >= self.max_targets:
                self.refused_admission += 1
                raise AdmissionRefused(ADMISSION, f"{len(others)} targets attached; N_max is {self.max_targets}")
            mine = sum(s.caller == caller for s in others)
            if self.max_per_caller is not None and mine >= self.max_per_caller:
                raise AdmissionRefused(CALLER, f"this caller holds {mine} sessions; the cap per caller is "
                                       f"{self.max_per_caller}")
            if old is not None:
                del self._by_tag[old.tag]
                old.detached = True
            tag = secrets.token_bytes(TAG_BYTES)
            s = Session(tag=tag, worker_id=worker_id, caller=caller, no_training=no_training)
            self._by_tag[tag] = s
            return s, old

    def _check_replaceable(self, old: Session, caller: str) -> None:
        """Refuse ("worker_id") an Attach that may not replace `old` yet (see the module's notes)."""
        now, wait = time.monotonic(), self.reclaim_after_s
        if now - old.attached_s < wait:
            why = f"it attached {now - old.attached_s:.1f} s ago"
        elif old.caller != caller and now - old.last_round_s < wait:
            why = f"another caller's session had a round {now - old.last_round_s:.1f} s ago"
        else:
            return
        raise AdmissionRefused(WORKER_ID, f"worker {old.worker_id!r} is attached and live ({why}); it is "
                               f"replaced once {wait:g} s old, by another caller once {wait:g} s without rounds")

    def get(self, tag: bytes, caller: str | None = None) -> Session:
        """caller: the RPC's caller, who must be the one that attached (None: the server itself)."""
        with self._lock:
            s = self._by_tag.get(tag)
            if s is None or (caller is not None and s.caller != caller):  # another's tag looks like no tag
                raise UnknownTag()
            s.last_seen_s = time.monotonic()
            return s

    def open_stream(self, tag: bytes, caller: str = "") -> Session:
        with self._lock:
            s = self._by_tag.get(tag)
            if s is None or s.streaming or s.caller != caller:
                raise UnknownTag()
            s.streaming = True
            return s

    def detach(self, tag: bytes) -> Session | None:
        with self._lock:
            s = self._by_tag.pop(tag, None)
            if s is not None:
                s.detached = True
            return s

    def idle_streams(self, idle_s: float) -> list[Session]:
        now = time.monotonic()
        with self._lock:
            return [s for s in self._by_tag.values() if s.streaming and now - s.last_round_s > idle_s]

    def expired(self, lease_s: float) -> tuple[list[bytes], list[tuple[bytes, int]]]:
        """Tags never streamed within the lease, and sequences unused for the lease."""
        now = time.monotonic()
        with self._lock:
            tags = [t for t, s in self._by_tag.items() if not s.streaming and now - s.last_seen_s > lease_s]
            seqs = [(t, q) for t, s in self._by_tag.items() if t not in tags
                    for q, used in s.seq_last_used.items() if now - used > lease_s]
            return tags, seqs

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._by_tag.values())

    def __len__(self) -> int:
        return len(self._by_tag)
