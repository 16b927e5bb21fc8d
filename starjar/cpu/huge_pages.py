"""A float model's weights moved into one block of memory backed by huge pages.

A batch-1 step streams every weight once. Loaded from safetensors, the weights lie in a private mapping of the
file, in 4 KB pages: streaming 540 MB a token walks 130k pages, and the streams restart at page edges. In an
anonymous mapping advised for transparent huge pages (2 MB) the same products read faster: on a 2-core AMD
EPYC (AVX2) the own one-row product over a 113 MB output layer went from 21-22 to 24-27 GB/s.

The values are copied bit for bit and each parameter is rebound to its view of the block, so every pass computes
what it computed before. Groups of weights that the lean target concatenates (q, k and v; gate and up) are laid
next to each other, so their concatenation is a view of the block too (starjar.model.fused_projections), not a
copy. STARJAR_HUGE_PAGES=0 leaves the weights where they were loaded; where the system offers no transparent
huge pages the block still replaces the file mapping (its pages are then 4 KB).
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "STARJAR_HUGE_PAGES"
HUGE = 2 << 20  # a transparent huge page on x86-64
ALIGN = 4096  # where each group starts: a page, and every kernel's alignment
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def wanted() -> bool:
    """Whether weights are moved (STARJAR_HUGE_PAGES unset or not 0) and this system can advise a mapping."""
    return os.environ.get(ENV, "1").strip() != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def system_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise, never, or unknown."""
    try:
        text = _THP.read_text()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "unknown"


def block(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory (uint8) starting on a 2 MB boundary, advised for huge pages. The mapping spans
    whole huge pages past that boundary, so even a block under 2 MB lies in one the kernel can back."""
    whole = -(-nbytes // HUGE) * HUGE
    region = mmap.mmap(-1, whole + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as a view of it lives
    skip = -raw.data_ptr() % HUGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # a kernel without transparent huge pages: the block still works, in 4 KB pages
        log.info("huge pages not advised (%s): the weights' block uses small pages", exc)
    return raw[skip:skip + nbytes]


def _groups(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The tensors to lay back to back: per decoder layer the q/k/v weights, their biases, the gate/up weights
    and theirs (rehome takes a group where its members are alike and not placed yet)."""
    groups: list[list[torch.Tensor]] = []
    base = getattr(model, "model", None)
    for layer in getattr(base, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for lins in ([getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")],
                     [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]):
            if not all(isinstance(lin, torch.nn.Linear) for lin in lins):
                continue
            groups.append([lin.weight for lin in lins])
            if all(lin.bias is not None for lin in lins):
                groups.append([lin.bias for lin in lins])
    return groups


def rehome(model: torch.nn.Module) -> int:
    """Every CPU float parameter of model copied into one huge-page block (groups adjacent) and rebound to its
    view there; tied parameters stay one. Returns the block's bytes (0 where nothing was moved)."""
    params = {id(p): p for p in model.parameters() if p.device.type == "cpu" and p.dtype.is_floating_point}
    if not wanted() or not params:
        return 0
    placed: set[int] = set()
    layout: list[list[torch.nn.Parameter]] = []
    for grp in _groups(model):
        if all(id(t) in params and id(t) not in placed and t.dtype == grp[0].dtype for t in grp):
            layout.append(grp)
            placed.update(id(t) for t in grp)
    layout += [[p] for key, p in params.items() if key not in placed]
    with torch.no_grad():
        for grp, views in zip(layout, _laid(layout), strict=True):
            for p, view in zip(grp, views, strict=True):
                p.data = view
    total = sum(_span(grp) for grp in layout)
    log.info("weights moved into %.0f MB of memory advised for huge pages (system mode: %s)", total / 1e6,
             system_mode())
    return total


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the tensors in one huge-page block (each on a page of its own), where wanted(); else the
    tensors themselves."""
    if not wanted() or not tensors:
        return list(tensors)
    return [views[0] for views in _laid([[t] for t in tensors])]


def _span(grp: list[torch.Tensor]) -> int:
    return -(-sum(t.numel() * t.element_size() for t in grp) // ALIGN) * ALIGN


def _laid(layout: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each group's tensors copied back to back into one block, each group from a page boundary."""
    mem = block(sum(_span(grp) for grp in layout))
    laid, offset = [], 0
    with torch.no_grad():
        for grp in layout:
            views = []
            for t in grp:
                n = t.numel() * t.element_size()
                views.append(mem[offset:offset + n].view(t.dtype).view(t.shape))
                views[-1].copy_(t.detach())
                offset += n
            laid.append(views)
            offset = -(-offset // ALIGN) * ALIGN
    return laid


def adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one tensor stacked along dim 0 without a copy, where they lie back to back in one storage
    (contiguous, alike in dtype and trailing shape); None otherwise."""
    first = tensors[0]
    storage = first.untyped_storage()
    end = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or \
                t.data_ptr() != end or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *first.shape[1:])
    return torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), shape,
                                                  torch.empty(shape, device="meta").stride())
