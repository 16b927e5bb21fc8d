"""Drafts that are int8 copies of their target.

A dynamically quantized copy of the target (weights int8 per output channel,
activations quantized on the fly) proposes almost what the target would, at a
fraction of its cost on a CPU. Verification stays exact, so the output is
still the target's own.

Activations are quantized per row (per token), not per tensor as torch's
dynamic linear does: with one scale for a whole pass, a prompt's outlier
tokens (the first ones carry activations orders of magnitude larger) crush
every other token to a few levels, and in a batch one sequence's rows change
another's drafts. Per row, the draft's output no longer depends on what else
is in the pass. On the default pair this took gamma = 3 acceptance from 0.54
to 0.80 (13 Spec-Bench prompts). One-row passes (batch-1 decode steps, where
per tensor is per row) keep torch's fused kernel, the fastest path.

A draft directory of this kind holds the tokenizer, the config and a
`starjar.json` recipe {"kind": "dynamic-int8", "weights_from": "<target dir>"};
the weights are quantized when the draft loads (under a second), never stored.
"""

from __future__ import annotations

import warnings

import torch

KIND = "dynamic-int8"


WIDE = 8192  # output features from which torch._int_mm on a few rows is slower than the fused kernel


class RowInt8Linear(torch.nn.Module):
    """An int8 linear with per-output-channel weight scales and per-row dynamic activation scales.

    One row (a batch-1 decode step) goes through torch's fused dynamic kernel, where one range per tensor
    is one range per row. Several rows are quantized symmetrically per row (8 bits) and multiplied with
    torch._int_mm, except in a layer as wide as a vocabulary, where _int_mm on a few rows is 3-4x slower:
    there each row is divided by its absolute maximum before the fused kernel (which then gives every row
    most of its range) and multiplied back.
    """

    def __init__(self, qlinear: torch.nn.Module):
        super().__init__()
        self.fused = qlinear  # torch's dynamic int8 linear (per-channel weights, one activation range)
        self.in_features, self.out_features = qlinear.in_features, qlinear.out_features
        w = qlinear.weight()
        self.wide = self.out_features >= WIDE
        # The same int8 weights and scales, laid out for _int_mm (not kept for wide layers, which never use them).
        self.register_buffer("w_t", None if self.wide else w.int_repr().t().contiguous())
        self.register_buffer("w_scale", None if self.wide else w.q_per_channel_scales().float()[None, :].contiguous())
        b = qlinear.bias()
        self.register_buffer("bias", None if b is None else b.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:
            return self.fused(x)
        if self.wide:
            peak = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
            y = self.fused(x / peak)
            return y * peak if self.bias is None else (y - self.bias) * peak + self.bias
        rows = x.reshape(-1, self.in_features)
        scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        y = torch._int_mm(torch.round(rows / scale).to(torch.int8), self.w_t).float() * (scale * self.w_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Every nn.Linear becomes an int8 linear: per-channel weight scales, per-row activation scales (CPU)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices, once per load
        model = quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DynamicLinear):
                setattr(parent, name, RowInt8Linear(child))
    return model
