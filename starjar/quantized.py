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


class RowInt8Linear(torch.nn.Module):
    """An int8 linear with per-output-channel weight scales and per-row dynamic activation scales.

    torch's fused dynamic kernel picks one activation range per tensor; dividing every row by its own
    absolute maximum first gives each row the full range (within a factor of two: the kernel's range is
    asymmetric), and multiplying back restores the scale. Three cheap ops, and the fast kernel for any
    number of rows (torch._int_mm is 3-4x slower on a few rows of a wide layer such as the vocabulary).
    """

    def __init__(self, qlinear: torch.nn.Module):
        super().__init__()
        self.fused = qlinear  # torch's dynamic int8 linear (per-channel weights, one activation range)
        self.in_features, self.out_features = qlinear.in_features, qlinear.out_features
        b = qlinear.bias()
        self.register_buffer("bias", None if b is None else b.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:  # one row: per tensor is per row
            return self.fused(x)
        peak = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        y = self.fused(x / peak)
        if self.bias is None:
            return y * peak
        return (y - self.bias) * peak + self.bias


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
