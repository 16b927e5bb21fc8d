"""Ragged batched KV cache for any Hugging Face causal LM.

Every live sequence owns a slot: one row of a per-layer buffer
[slots, kv_heads, capacity, head_dim] plus its own length. A forward pass
runs over a set of slots, each adding its own number of new tokens; the
cache writes them at each slot's own offset, so sequences of different
lengths share one pass and nothing is recomputed when others join or leave.

Rollback (rejected drafts) only lowers a slot's length: stale entries past it
are never attended, because the 4D mask built by `attention_mask` only opens
positions below each query's own position, and they are overwritten later.

Slots are kept compact (live slots are 0..n-1): releasing a slot moves the
last one into the hole, so the common full-batch pass reads a view, not a copy.

The model sees this object as its `past_key_values`: it calls `update()` once
per attention layer with the new keys/values [B, H, Q, D] and attends over
what it returns. Buffers are allocated lazily on that first call, so the
cache needs no knowledge of the architecture (Llama, Qwen2, GPT-2, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from starjar.model.tree_attention import tree_layout

# pass_views(): per-layer K and V to write, scattered slots (or None), write positions (or None: one span), span
# start, keys to attend
PassViews = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None, torch.Tensor | None, int, int]


class RaggedKVCache(Cache):
    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 initial_slots: int = 4, initial_capacity: int = 256, max_cells: int | None = None):
        super().__init__(layers=[])
        # Growth doubles, but never past slots x length = max_cells unless a pass needs more (the draft
        # server keeps what it admits within this, so its KV memory stays within its budget).
        self.max_cells = max_cells
        self.device = torch.device(device)
        self.dtype = dtype
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._slot_cap = initial_slots
        self._len_cap = initial_capacity
        self.lengths: list[int] = []  # valid tokens per live slot; len() = live slots
        self._owners: list[object] = []  # who holds each slot; their `.slot` follows compaction
        # Set by begin() for the pass in flight.
        self._rows: torch.Tensor | slice | None = None
        self._write_pos: torch.Tensor | None = None  # [B, Q] absolute positions to write
        self._write_span: slice | None = None  # the same positions for every row, when they are
        self._tree_pass = False  # the pass has token-tree rows (their mask is not a plain prefix)
        self._kv_len = 0
        self._views: tuple | None = None  # _row_views' last views, with the rows and buffers they are of

    # ---- slot management (between passes) -------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    def allocate(self, owner: object = None) -> int:
        """A new empty slot; returns its index. An owner with a `slot` attribute gets it set,
        and kept current when compaction moves it."""
        self.lengths.append(0)
        self._owners.append(owner)
        if owner is not None and hasattr(owner, "slot"):
            owner.slot = self.num_slots - 1
        if self.num_slots > self._slot_cap:
            self._grow(slots=max(self.num_slots, 2 * self._slot_cap))
        return self.num_slots - 1

    def free(self, slot: int) -> int | None:
        """Drop a slot. Returns the index of the slot moved into its place (the old last), if any."""
        last = self.num_slots - 1
        moved = None
        if slot != last:
            n = self.lengths[last]
            for buf in self._keys + self._values:
                buf[slot, :, :n] = buf[last, :, :n]
            self.lengths[slot] = n
            self._owners[slot] = self._owners[last]
            if self._owners[slot] is not None and hasattr(self._owners[slot], "slot"):
                self._owners[slot].slot = slot
            moved = last
        self.lengths.pop()
        self._owners.pop()
        return moved

    def owner(self, slot: int) -> object:
        """Who holds a slot (what allocate() was given)."""
        return self._owners[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Roll a slot back to its first `length` tokens."""
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        self.lengths[slot] = length

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy the KV at positions src to positions dst of a slot (an accepted tree path made contiguous)."""
        if src == dst:
            return
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for buf in self._keys + self._values:
            buf[slot, :, d] = buf[slot, :, s]

    def prefix(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, views of (K, V) [heads, n, dim] at a slot's first n positions (none before a first pass)."""
        assert n <= self.lengths[slot], (n, self.lengths[slot])
        return [(k[slot, :, :n], v[slot, :, :n]) for k, v in zip(self._keys, self._values, strict=True)]

    def load_prefix(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Fill an empty slot with another cache's prefix (prefix()'s layers, the same heads and dims): the slot
        then holds its n tokens, converted to this cache's dtype. False (nothing written) when the cache has
        no room for n positions within max_cells."""
        assert self.lengths[slot] == 0 and layers, (self.lengths[slot], len(layers))
        return self.append_kv(slot, layers)

    def append_kv(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """The next n positions of a slot from computed keys and values (prefix()'s layers' shape), converted to
        this cache's dtype; False (nothing written) when the cache has no room for them within max_cells."""
        k0, v0 = layers[0]
        at, n = self.lengths[slot], k0.shape[1]
        self.reserve(at + n)
        self.make_buffers(len(layers), k0.shape[0], k0.shape[2], v0.shape[2])
        if at + n > self._len_cap:
            return False
        for (k, v), kbuf, vbuf in zip(layers, self._keys, self._values, strict=True):
            kbuf[slot, :, at:at + n] = k
            vbuf[slot, :, at:at + n] = v
        self.lengths[slot] = at + n
        return True

    def tokens_used(self) -> int:
        return sum(self.lengths)

    # ---- one forward pass ---------------------------------------------------------------

    def begin(self, slots: list[int], new_counts: list[int],
              trees: list[tuple[int, Sequence[int]] | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a pass where slots[b] adds new_counts[b] tokens (padded to Q = max).

        Returns (position_ids [B, Q], attention_mask [B, 1, Q, K]) for the model call.
        Padding queries attend like real ones (so no row is empty) and their writes land
        past the slot's valid length, where nothing real ever looks.
        trees: per row, None (a chain) or (cached, parents) of a token tree (see _tree_rows and
        starjar.model.tree_attention): its tokens are positioned by depth and see only their ancestors.
        """
        B, Q = len(slots), max(new_counts)
        if B == 1 and Q == 1 and not self.max_cells and not any(t is not None for t in trees or ()):
            return self._begin_one(slots[0])
        starts = torch.tensor([self.lengths[s] for s in slots], dtype=torch.long)
        pos = starts[:, None] + torch.arange(Q)[None, :]  # [B, Q]
        self._kv_len = int(pos.max()) + 1
        write = pos
        if self.max_cells:
            # A budgeted cache never grows for padding: a padded row's padding writes go to one position past
            # its valid length (garbage, never attended), not up to its start + Q (measured: a 178-token catch-up
            # beside rows at 4000 tokens grew a full 64 x 4096 cache by 2%, and its copy for a while by 6%).
            counts = torch.tensor(new_counts, dtype=torch.long)
            self._kv_len = int((starts + counts + (counts < Q).long()).max())
            write = pos.clamp(max=self._kv_len - 1)
        if self._kv_len > self._len_cap:
            self._grow(length=_room_for(self._kv_len, self._len_cap))
        contiguous = slots == list(range(slots[0], slots[0] + B))
        self._rows = slice(slots[0], slots[0] + B) if contiguous else torch.tensor(slots, dtype=torch.long)
        self._write_pos = write.to(self.device)
        # Every row writing the same positions (batch 1 always): a slice copy, not a scatter (10 vs 17 us a write).
        first = self.lengths[slots[0]]
        self._write_span = slice(first, first + Q) if contiguous and all(self.lengths[s] == first for s in slots) \
            else None
        key_pos = torch.arange(self._kv_len)
        allowed = key_pos[None, None, :] <= pos[:, :, None]  # [B, Q, K]
        pos_ids = _tree_rows(pos, allowed, starts, trees) if trees else pos
        self._tree_pass = any(t is not None for t in trees or ())
        mask = torch.zeros(B, 1, Q, self._kv_len, dtype=self.dtype)
        mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype).min)
        for s, n in zip(slots, new_counts, strict=True):
            self.lengths[s] += n
        return pos_ids.to(self.device), mask.to(self.device)

    def _begin_one(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """begin() for one token on one slot: what the general path gives (every key up to it visible), in two
        small tensors. A batch-1 step runs this between passes that stream the weights past every cache, where
        each further op cost about 0.05-0.09 ms (2-core AMD EPYC, Zen 4) against 0.01 warm."""
        start = self.lengths[slot]
        self._kv_len = start + 1
        if self._kv_len > self._len_cap:
            self._grow(length=_room_for(self._kv_len, self._len_cap))
        pos = torch.tensor([[start]], dtype=torch.long, device=self.device)
        self._rows = slice(slot, slot + 1)
        self._write_pos = pos
        self._write_span = slice(start, start + 1)
        self._tree_pass = False
        self.lengths[slot] += 1
        return pos, torch.zeros(1, 1, 1, self._kv_len, dtype=self.dtype, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, H, Q, D] for the slots given to begin().
        if layer_idx == len(self._keys):
            shape = (self._slot_cap, key_states.shape[1], self._len_cap, key_states.shape[3])
            self._keys.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            self._values.append(torch.zeros(shape[:3] + (value_states.shape[3],), dtype=self.dtype,
                                            device=self.device))
        kbuf, vbuf = self._keys[layer_idx], self._values[layer_idx]
        rows, pos = self._rows, self._write_pos
        if isinstance(rows, slice):
            k_rows, v_rows = kbuf[rows], vbuf[rows]  # views
            span = self._write_span
            if span is not None:
                k_rows[:, :, span] = key_states
                v_rows[:, :, span] = value_states
            else:
                idx = pos[:, None, :, None]
                k_rows.scatter_(2, idx.expand_as(key_states), key_states.to(self.dtype))
                v_rows.scatter_(2, idx.expand(-1, value_states.shape[1], -1, value_states.shape[3]),
                                value_states.to(self.dtype))
            return k_rows[:, :, : self._kv_len], v_rows[:, :, : self._kv_len]
        # Scattered slots: write through advanced indexing, then gather (a copy).
        b = rows[:, None].expand_as(pos)
        kbuf[b, :, pos] = key_states.transpose(1, 2).to(self.dtype)
        vbuf[b, :, pos] = value_states.transpose(1, 2).to(self.dtype)
        return kbuf[rows, :, : self._kv_len], vbuf[rows, :, : self._kv_len]

    def make_buffers(self, layers: int, heads: int, key_dim: int, value_dim: int) -> None:
        """The buffers update() makes on a cache's first pass, made now, so that a forward writing through
        pass_views can run that pass too."""
        if self._keys:
            return
        for _ in range(layers):
            self._keys.append(torch.zeros((self._slot_cap, heads, self._len_cap, key_dim), dtype=self.dtype,
                                          device=self.device))
            self._values.append(torch.zeros((self._slot_cap, heads, self._len_cap, value_dim), dtype=self.dtype,
                                            device=self.device))

    @property
    def tree_pass(self) -> bool:
        """Whether the pass begin() prepared has token-tree rows: only its mask says which keys a token sees."""
        return self._tree_pass

    def pass_views(self, layers: int, trees: bool = False) -> PassViews | None:
        """For the pass begin() prepared, unless it is a tree pass (trees: unless the caller attends with the
        pass's mask, which holds the tree) or one of `layers` layers has no buffers yet:
        (per layer K and V to write in place: the rows' buffers, views, for consecutive slots, else the whole
        buffers; the slots [B] when scattered, else None; the write positions [B, Q], or None when every row
        writes one span; the span's first position; the keys to attend). None otherwise (then update() writes)."""
        if self._rows is None or len(self._keys) != layers or (self._tree_pass and not trees):
            return None
        rows, span = self._rows, self._write_span
        if not isinstance(rows, slice):
            return self._keys, self._values, rows, self._write_pos, 0, self._kv_len
        keys, values = self._row_views(rows)
        return keys, values, None, None if span is not None else self._write_pos, \
            span.start if span is not None else 0, self._kv_len

    def _row_views(self, rows: slice) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V views of the slots in rows, made again only when the rows or a buffer changed
        (60 views cost 0.2 ms a step on the default target, a 2-core AMD EPYC)."""
        held, bufs = self._views, self._keys + self._values
        if held is None or held[0] != (rows.start, rows.stop) or len(held[1]) != len(bufs) or \
                any(a is not b for a, b in zip(held[1], bufs, strict=True)):
            held = ((rows.start, rows.stop), bufs,
                    [k[rows] for k in self._keys], [v[rows] for v in self._values])
            self._views = held
        return held[2], held[3]

    def write_positions(self) -> torch.Tensor | None:
        """Where the pass begin() prepared writes each new token: absolute positions [B, Q] on the device."""
        return self._write_pos

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    # ---- storage --------------------------------------------------------------------------

    def reserve(self, length: int) -> None:
        """Room for `length` positions per slot before a prompt goes in over several passes: one growth (every
        buffer allocated, zeroed and copied: 0.5-0.9 s for 16 slots of 1024 on the default pair's draft) instead
        of one per pass."""
        if length <= self._len_cap:
            return
        if not self._keys:  # buffers not made yet: they will be made this long (within the budget)
            room = _room_for(length, self._len_cap)
            if not self.max_cells or room * self._slot_cap <= self.max_cells:
                self._len_cap = room
            return
        self._grow(length=_room_for(length, self._len_cap))

    def _grow(self, slots: int | None = None, length: int | None = None) -> None:
        """Grow to at least (slots, length); the doubling is clamped to max_cells."""
        slots = slots or self._slot_cap
        length = length or self._len_cap
        if self.max_cells:  # the length may even shrink to the longest live slot, to make room for a slot
            need_slots = max(self.num_slots, self._slot_cap)
            need_len = max([self._kv_len, *self.lengths])
            slots = max(need_slots, min(slots, self.max_cells // max(1, need_len)))
            length = max(need_len, min(length, self.max_cells // max(1, slots)))
        self._views = None  # they hold the old buffers
        for bufs in (self._keys, self._values):
            for i, old in enumerate(bufs):
                new = torch.zeros((slots, old.shape[1], length, old.shape[3]), dtype=old.dtype, device=old.device)
                n = min(length, old.shape[2])
                new[: old.shape[0], :, :n] = old[:, :, :n]
                bufs[i] = new
        self._slot_cap, self._len_cap = slots, length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values)


def _room_for(length: int, capacity: int) -> int:
    """The capacity to grow to for `length` positions: at least double, and a power of two, so that a 770-token
    prompt grows the cache once (to 1024), not to 771 and then to 1542 at its first decode step."""
    return max(2 * capacity, 1 << max(0, length - 1).bit_length())


def _tree_rows(pos: torch.Tensor, allowed: torch.Tensor, starts: torch.Tensor,
               trees: list[tuple[int, Sequence[int]] | None]) -> torch.Tensor:
    """Position ids and mask rows for the tree rows of a pass (edits `allowed` in place). A tree row is
    (cached, parents): the row's tree region began `cached` tokens before this pass's first new token, and
    parents covers the whole region (cached + new tokens), its first token being the root."""
    pos_ids = pos.clone()
    for b, tree in enumerate(trees):
        if tree is None:
            continue
        cached, parents = tree
        region = int(starts[b]) - cached  # the root's position
        new = len(parents) - cached
        depth, sees = tree_layout(parents)
        pos_ids[b, :new] = region + depth[cached:]
        allowed[b, :new, region: region + len(parents)] = sees[cached:]
    return pos_ids
