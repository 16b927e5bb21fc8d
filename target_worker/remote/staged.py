"""Drafts a draft server pushed ahead (lookahead on, draft_server.lookahead), kept until a round uses them.

A push names the verified length and the tokens its drafts assume come next; with fanout a sequence gets
several for one verified length (full acceptance and its likeliest rejections). A round whose delta is exactly
one of them (same start, same tokens) takes its drafts at once instead of waiting for the reply: the round is sent all
the same, so the server's state moves on, and its reply (the same drafts) is dropped when it comes. A push
that came too late, or for another outcome, never matches a later round (its start has moved on). Only
proposals are taken from it: verification decides what is kept, so a wrong push costs speed, never tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from starjar.spec.proposer import DraftRequest

MAX_STAGED = 4096  # sequences with a push kept at most (a faulty server cannot grow this without bound)
MAX_OUTCOMES = 8  # pushes kept per sequence, for one verified length


class StagedDrafts:
    def __init__(self):
        # wire id -> [(start, assumed, drafts)], all for one start
        self._by_wire: dict[int, list[tuple[int, tuple[int, ...], list[int]]]] = {}
        self._lock = threading.Lock()  # pushes arrive on the loop thread, rounds ask on the engine's
        self.used = 0  # rounds answered from pushes

    def take_push(self, resp) -> None:
        """On the loop thread: a push (a pb.SpeculateResponse with round_id 0) joins the sequence's pushes for
        the same start (one for the same outcome replaced) and replaces those for any other start."""
        with self._lock:
            for s in resp.staged:
                assumed = tuple(s.assumed)
                kept = [p for p in self._by_wire.pop(s.seq_id, []) if p[0] == s.start and p[1] != assumed]
                if len(self._by_wire) >= MAX_STAGED:
                    self._by_wire.pop(next(iter(self._by_wire)))
                self._by_wire[s.seq_id] = kept[-(MAX_OUTCOMES - 1):] + [(s.start, assumed, list(s.drafts))]

    def replies(self, sent: Sequence[DraftRequest], wire: Sequence[int]) -> list[list[int]] | None:
        """Every sequence's drafts for this round when pushes have them all (chains with enough drafts), else
        None. Those taken are used up."""
        with self._lock:
            found = []
            for r, w in zip(sent, wire, strict=True):
                tokens = tuple(int(t) for t in r.tokens)
                push = next((p for p in self._by_wire.get(w, ()) if p[0] == r.start and p[1] == tokens), None)
                if push is None or r.tree_width > 1 or r.gamma <= 0 or len(push[2]) < r.gamma:
                    return None
                found.append(push[2][:r.gamma])
            for w in wire:
                self._by_wire.pop(w, None)
            self.used += 1
            return found

    def drop(self, wire: Sequence[int]) -> None:
        with self._lock:
            for w in wire:
                self._by_wire.pop(w, None)

    def clear(self) -> None:
        with self._lock:
            self._by_wire.clear()
