"""Rotary cos and sin per position, computed once, where the rows of a table give the rotary module's bits.

HF's rotary embedding recomputes cos and sin for every pass from the positions (about 15 small ops: 0.13 ms of
a default-target step on a 2-core AMD EPYC). Each value depends only on its position and frequency (a product of
one multiply, then cos or sin), so a table's rows are the same numbers, provided every element went through the
same vectorized kernel: ATen's vector loops finish a tail shorter than two vectors with the scalar function,
whose last bit may differ. Rows of a head dimension divisible by 32 never leave a tail (8- and 16-lane floats);
the table is also checked against the module at build time and not used where any row differs, nor for rope
types whose frequencies change with the sequence length.
"""

from __future__ import annotations

import torch
from torch import Tensor

STATIC_TYPES = ("default", "linear", "llama3")  # frequencies fixed at load
FIRST = 1024  # positions in the first table; it doubles as positions pass it
CHECKED = (0, 1, 2, 3, 17, 100, 511, 1023)  # positions checked one by one against the module


class RopeTable:
    def __init__(self, rotary: torch.nn.Module, head_dim: int):
        self.rotary = rotary
        self.usable = head_dim % 32 == 0 and getattr(rotary, "rope_type", "default") in STATIC_TYPES
        self._tables: dict[torch.dtype, tuple[Tensor, Tensor, Tensor]] = {}

    def lookup(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """cos, sin and sin with rotate_half's sign folded in (its first half negated), each [B, 1, Q, D], for
        position_ids [B, Q]; None where the table is not used (then the caller runs the module)."""
        if not self.usable:
            return None
        need = int(position_ids.max()) + 1
        held = self._tables.get(x.dtype)
        if held is None or held[0].shape[0] < need:
            held = self._build(x, max(FIRST, 1 << (need - 1).bit_length()))
            if held is None:
                return None
        cos, sin, signed = held
        return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1), signed[position_ids].unsqueeze(1)

    @torch.no_grad()
    def _build(self, x: Tensor, length: int) -> tuple[Tensor, Tensor, Tensor] | None:
        probe = x.new_zeros(1, 1, x.shape[-1])
        cos, sin = self.rotary(probe, position_ids=torch.arange(length, device=x.device)[None])
        cos, sin = cos[0], sin[0]
        for p in (c for c in CHECKED if c < length):
            one_cos, one_sin = self.rotary(probe, position_ids=torch.tensor([[p]], device=x.device))
            if not (torch.equal(one_cos[0, 0], cos[p]) and torch.equal(one_sin[0, 0], sin[p])):
                self.usable = False
                return None
        half = sin.shape[-1] // 2
        held = (cos, sin, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        self._tables[x.dtype] = held
        return held
