"""The training signal: every target's verified tokens, as the draft server already receives them.

The draft server learns what the targets verified from each round's deltas (the
tokens verified since the last round, at an explicit position). This module
keeps, per live sequence, the verified tokens and the drafts last proposed for
it: the next round's delta says how many of those drafts were accepted (the
acceptance TIDE's controller watches), and, while collection is on, a released
sequence's tokens go to a bounded buffer of finished sequences for the trainer.
While collecting, the draft's own last hidden state at each position of a
tracked sequence (computed anyway when the draft server drafts; see
`keep_hidden`) is kept beside its tokens: the trainer learns from it without
running the draft again, as TIDE learns from states the serving pass made.

Memory only: nothing here is ever written to disk or to a log, and every part
is bounded (live sequences, tokens per sequence, finished sequences and their
tokens). A target that attached with no_training is never recorded.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from starjar.errors import InvalidArgument
from starjar.spec.token_ids import common_prefix


@dataclass(frozen=True)
class BufferConfig:
    max_live: int = 1024  # sequences tracked at once (the oldest tracked is forgotten past it)
    max_sequence_tokens: int = 1024  # tokens kept of one sequence (its first ones)
    max_sequences: int = 256  # finished sequences held for training
    max_tokens: int = 1 << 16  # their tokens in all (the oldest are dropped past it)
    max_hidden_rows: int = 16384  # hidden states kept, live and finished (about 38 MB at hidden size 576)

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_live", 1, 1 << 20), ("max_sequence_tokens", 2, 1 << 20),
                             ("max_sequences", 1, 1 << 20), ("max_tokens", 2, 1 << 30),
                             ("max_hidden_rows", 0, 1 << 24)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise InvalidArgument(name, f"must be in [{lo}, {hi}]", v)


@dataclass(eq=False)
class _Live:
    tokens: array = field(default_factory=lambda: array("i"))  # verified, from position 0 (the first ones)
    length: int = 0  # verified tokens the target has told of (tokens may hold fewer: the cap)
    prompt_len: int = 0  # the first delta's length: what the target sent before any drafting
    drafts: list[int] = field(default_factory=list)  # proposed after `tokens`, not yet verified
    complete: bool = True  # False once a delta did not continue `tokens` (the copy has a gap)
    collected: bool = False  # collection was on at some point of its life
    hidden: dict = field(default_factory=dict)  # position -> the draft's last hidden state there (a tensor)


@dataclass(frozen=True)
class Finished:
    tokens: tuple[int, ...]
    prompt_len: int  # positions before this were the prompt; the trainer learns to predict the rest
    hidden: dict = field(default_factory=dict)  # position -> hidden state, as the serving draft computed it


class TrainingBuffer:
    """Owned by the compute thread; GetStats and metrics read its counters only."""

    def __init__(self, cfg: BufferConfig | None = None):
        self.cfg = cfg or BufferConfig()
        self._live: OrderedDict[Hashable, _Live] = OrderedDict()
        self.finished: deque[Finished] = deque()
        self.tokens = 0  # tokens in `finished`
        self.hidden_rows = 0  # hidden states held, live and finished
        self.added = 0  # finished sequences ever added (the trainer takes those it has not seen)

    def observe(self, seq_id: Hashable, start: int, tokens: Iterable[int], drafts: list[int] | None,
                collecting: bool) -> tuple[int, int] | None:
        """One answered round of one sequence: its delta (start, tokens) and the drafts proposed after it
        (None: answered resync). Returns (accepted, proposed) for the drafts of its previous round when
        this delta continues them, else None."""
        tokens = list(tokens)
        seq = self._live.get(seq_id)
        if seq is None or start == 0:
            self._drop_live(seq_id)
            seq = _Live(prompt_len=len(tokens))
            self._live[seq_id] = seq
            while len(self._live) > self.cfg.max_live:
                self._drop_live(next(iter(self._live)))
        self._live.move_to_end(seq_id)
        outcome = None
        if seq.drafts and start == seq.length:
            outcome = (common_prefix(seq.drafts, tokens), len(seq.drafts))
        if start > seq.length:  # a gap: what is kept no longer matches the sequence
            seq.complete = False
        del seq.tokens[start:]
        room = self.cfg.max_sequence_tokens - len(seq.tokens)
        if start == len(seq.tokens):
            seq.tokens.extend(tokens[:max(0, room)])
        seq.length = start + len(tokens)
        seq.drafts = list(drafts or [])
        seq.collected = seq.collected or collecting
        return outcome

    def keep_hidden(self, seq_id: Hashable, first: int, rows) -> None:
        """The draft's last hidden states [n, hidden] at positions first.. of a tracked sequence (a pass just
        fed them). Kept from the prompt's last position on, within the bounds; a later pass over the same
        position (after a rejected draft) replaces it, so what is left matches the verified tokens."""
        seq = self._live.get(seq_id)
        if seq is None or not seq.complete:
            return
        for i in range(max(0, seq.prompt_len - 1 - first), len(rows)):
            pos = first + i
            if pos >= self.cfg.max_sequence_tokens:
                break
            if pos not in seq.hidden:
                if self.hidden_rows >= self.cfg.max_hidden_rows:
                    break
                self.hidden_rows += 1
            seq.hidden[pos] = rows[i].clone()

    def release(self, seq_ids: Iterable[Hashable]) -> None:
        """Sequences the target released: finished. Those seen while collecting go to the buffer."""
        for sid in seq_ids:
            seq = self._live.get(sid)
            if seq is None or not seq.collected or not seq.complete or len(seq.tokens) <= seq.prompt_len:
                self._drop_live(sid)
                continue
            del self._live[sid]
            hidden = {p: h for p, h in seq.hidden.items() if p < len(seq.tokens) - 1}  # those with a next token
            self.hidden_rows -= len(seq.hidden) - len(hidden)
            self.finished.append(Finished(tuple(seq.tokens), min(seq.prompt_len, len(seq.tokens) - 1), hidden))
            self.tokens += len(seq.tokens)
            self.added += 1
            while len(self.finished) > self.cfg.max_sequences or self.tokens > self.cfg.max_tokens:
                old = self.finished.popleft()
                self.tokens -= len(old.tokens)
                self.hidden_rows -= len(old.hidden)

    def handed_over(self, seq: Finished) -> None:
        """The trainer took a finished sequence's hidden states into its own (bounded) pool."""
        self.hidden_rows -= len(seq.hidden)
        seq.hidden.clear()

    def _drop_live(self, seq_id: Hashable) -> None:
        seq = self._live.pop(seq_id, None)
        if seq is not None:
            self.hidden_rows -= len(seq.hidden)

    def forget_owner(self, owner: Hashable) -> None:
        """Drop what is tracked for one target's live sequences (seq ids are (owner, id))."""
        for sid in [s for s in self._live if isinstance(s, tuple) and s[0] == owner]:
            self._drop_live(sid)

    def take_new(self, seen: int) -> tuple[list[Finished], int]:
        """The finished sequences added after the first `seen` ever added (those still held), and the new
        count to pass next time."""
        new = min(self.added - seen, len(self.finished))
        return list(self.finished)[len(self.finished) - new:], self.added

    @property
    def live(self) -> int:
        return len(self._live)

