"""The draft server's KV cache: a RaggedKVCache that gives memory back after a burst.

The cache grows by doubling to hold the live sequences and never shrank: after
two targets sent 256 sequences of 511 tokens each, the draft server kept
1.3 GB with no sequence live. `shrink()` reallocates the buffers to what the
live slots hold plus room to grow; the engine calls it between rounds once
the live sequences use a small part of the cache (DraftEngine.shrink_cache).
"""

from __future__ import annotations

import torch

from starjar.model.kv_cache import RaggedKVCache
from starjar.model.loading import LoadedModel, kv_bytes_per_token

# A new cache's size (RaggedKVCache's defaults): a shrink never goes below it.
MIN_SLOTS = 4
MIN_LENGTH = 256
MAX_PASS_TOKENS = 2048  # tokens one draft pass feeds at most


class DraftKVCache(RaggedKVCache):
    def __init__(self, device: torch.device | str, dtype: torch.dtype, max_cells: int | None = None):
        super().__init__(device, dtype, initial_slots=MIN_SLOTS, initial_capacity=MIN_LENGTH, max_cells=max_cells)

    @property
    def capacity(self) -> tuple[int, int]:
        """(slots, positions per slot) the buffers have room for."""
        return self._slot_cap, self._len_cap

    def shrink(self, slots: int, length: int) -> bool:
        """Reallocate to room for (slots, length), never below what the live slots hold (their KV is copied).
        Call between passes. Whether the buffers shrank."""
        live, used = self.num_slots, max(self.lengths, default=0)
        slots = min(self._slot_cap, max(slots, live, 1))
        length = min(self._len_cap, max(length, used, 1))
        if (slots, length) == (self._slot_cap, self._len_cap):
            return False
        self._views = None  # they hold the old buffers
        for bufs in (self._keys, self._values):
            for i, old in enumerate(bufs):
                new = torch.zeros((slots, old.shape[1], length, old.shape[3]), dtype=old.dtype, device=old.device)
                new[:live, :, :used] = old[:live, :, :used]
                bufs[i] = new  # the old buffer goes now: at most one layer's old and new are held at once
        self._slot_cap, self._len_cap = slots, length
        return True


def pass_tokens(model: LoadedModel, max_kv_tokens: int | None, floor: int) -> int:
    """Tokens one pass may feed: MAX_PASS_TOKENS, or fewer where a pass's scratch (mask, attention scores and
    probabilities in fp32, per query token over the longest context) would pass a tenth of the KV budget."""
    if max_kv_tokens is None:
        return MAX_PASS_TOKENS
    heads = model.model.config.num_attention_heads
    per_query = 3 * model.max_context * heads * model.cache_dtype.itemsize  # scratch in the cache's precision
    return max(floor, min(MAX_PASS_TOKENS, max_kv_tokens * kv_bytes_per_token(model) // 10 // per_query))

