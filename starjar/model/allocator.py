"""glibc's allocator for a draft server: a pass's scratch stays in the heap, a KV cache's outgrown copies go back.

A prefill chunk of 512 tokens allocates activations of 1-6 MB per op (the default pair). Served by mmap, each one
is faulted in page by page and unmapped when freed: on the 2-core Intel Xeon (AVX512 capability) a 769-token
draft prefill took 0.8-1.8 s in `starjar serve draft` (about 400k page faults each) against 0.55 s in-process.
So allocations up to glibc's largest mmap threshold come from the heap, and freed heap memory stays for the
next pass (a high trim threshold). A KV cache that grows by doubling would then keep every copy it outgrew:
its owner calls give_back_free() when the cache's size changed, which returns every free page to the OS.
glibc only; elsewhere both are no-ops.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
M_MMAP_THRESHOLD = -3
SCRATCH_IN_HEAP = 32 << 20  # glibc's largest mmap threshold (64-bit): allocations below it come from the heap
TRIM_ABOVE = 256 << 20  # free memory at the heap's top kept for the next pass, up to this much


@lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_scratch_in_heap() -> bool:
    """Heap for allocations under SCRATCH_IN_HEAP, no automatic trimming below TRIM_ABOVE; whether glibc took it."""
    libc = _libc()
    try:
        return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, SCRATCH_IN_HEAP)
                    and libc.mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE))
    except AttributeError:
        return False


def give_back_free() -> bool:
    """Return every whole free page of every arena to the OS (malloc_trim); whether any was returned."""
    libc = _libc()
    try:
        return bool(libc and libc.malloc_trim(0))
    except AttributeError:
        return False
