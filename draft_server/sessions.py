"""Attached targets and their tags.

A tag is 16 bytes from the OS CSPRNG: the only credential a target has. A tag
is bound to at most one open Speculate stream; when that stream ends the tag
is detached and its sequences freed. Tags attached but never streamed are
reclaimed after the lease. Lookups of unknown tags all fail the same way, so
a caller learns nothing about which tags exist.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starjar.errors import NotFound, ServerBusy

TAG_BYTES = 16


class UnknownTag(NotFound, LookupError):
    """NOT_FOUND on the wire; deliberately carries no detail."""

    def __init__(self):
        super().__init__("unknown tag")


class AdmissionRefused(ServerBusy):
    """N_max targets are attached (RESOURCE_EXHAUSTED, the reason first in the message too)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"reason={reason}: {detail}", reason)


@dataclass
class Session:
    tag: bytes
    worker_id: str
    caller: str = ""  # who attached it (starjar.security.caller_identity): only they may use the tag
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

    def __init__(self, max_targets: int):
        self.max_targets = max_targets
        self._by_tag: dict[bytes, Session] = {}
        self._lock = threading.Lock()
        self.refused_admission = 0

    def attach(self, worker_id: str, caller: str = "", no_training: bool = False) -> Session:
        with self._lock:
            if len(self._by_tag) >= self.max_targets:
                self.refused_admission += 1
                raise AdmissionRefused("admission", f"{len(self._by_tag)} targets attached; N_max is "
                                       f"{self.max_targets}")
            tag = secrets.token_bytes(TAG_BYTES)
            s = Session(tag=tag, worker_id=worker_id, caller=caller, no_training=no_training)
            self._by_tag[tag] = s
            return s

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
