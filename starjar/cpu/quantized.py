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
is in the pass (up to one level: the kernel's range is still the pass's
[min, max] of rows scaled to a peak of 1, short of [-1, 1] when no row peaks
on one side; a row appended to pin it cost 6-8% of a batched round). On the
default pair this took gamma = 3 acceptance from 0.54 to 0.80 (13 Spec-Bench
prompts). One-row passes (batch-1 decode steps, where per tensor is per row)
keep torch's fused kernel, the fastest path.

A draft directory of this kind holds the tokenizer, the config and a
`starjar.json` recipe {"kind": "dynamic-int8", "weights_from": "<target dir>"};
the weights are quantized when the draft loads (under a second), never stored.
"""

from __future__ import annotations

import threading
import time
import warnings

import torch

from starjar.cpu.kernels import INT8_PATHS, PROBE_ROWS, chosen_path, forced_path, int_mm_uses_onednn

KIND = "dynamic-int8"
ACT_BITS = (7, 8)


_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic  # what torch's dynamic Linear.forward calls
WIDE = 8192  # output features from which torch._int_mm on a few rows is slower than the fused kernel


def dynamic_int8(linear: torch.nn.Linear) -> torch.nn.Module:
    """torch's dynamic int8 linear for one layer: weights int8 per output channel."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        return quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8)[0]


class RowInt8Linear(torch.nn.Module):
    """An int8 linear with per-output-channel weight scales and per-row dynamic activation scales.

    One row (a batch-1 decode step) goes through torch's fused dynamic kernel, where one range per tensor
    is one range per row. Several rows take the path `starjar.cpu.kernels` chose for this machine (int_mm or
    fused, see there); a layer as wide as a vocabulary always takes the fused one (_int_mm on a few rows of
    a 49k-wide layer is 3-4x slower even where it is fast).
    """

    def __init__(self, qlinear: torch.nn.Module, path: str = "fused", act_bits: int = 7):
        super().__init__()
        self.fused = qlinear  # torch's dynamic int8 linear (per-channel weights, one activation range)
        # Its op called directly, as its forward would (reduce_range as its version says): the module's own
        # forward costs 14 us a call on a 2-core AVX2 EPYC, 1.6 ms of a 37 ms draft step (121 calls).
        self._packed = qlinear._packed_params._packed_params
        # 7: fbgemm's reduced activation range (0..127), which its kernels without VNNI need to keep int16 pair
        # sums from saturating; 8: the full range, twice the levels (a saturated sum only costs a draft agreement,
        # which `models build` measures).
        self._reduce_range = act_bits == 7 and not (qlinear.version is None or qlinear.version < 4)
        self.in_features, self.out_features = qlinear.in_features, qlinear.out_features
        self.wide = self.out_features >= WIDE
        b = qlinear.bias()
        self.register_buffer("bias", None if b is None else b.detach().float())
        self.register_buffer("w_t", None)
        self.register_buffer("w_scale", None)
        self.path = "fused"
        self.set_path(path)

    def set_path(self, path: str) -> None:
        """Choose the multi-row kernel; the _int_mm layout of the weights is kept only when it is used."""
        self.path = "fused" if self.wide else path
        if self.path == "int_mm" and self.w_t is None:
            w = self.fused.weight()
            self.w_t = w.int_repr().t().contiguous()
            self.w_scale = w.q_per_channel_scales().float()[None, :].contiguous()
        elif self.path != "int_mm":
            self.w_t = self.w_scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:
            return _LINEAR_DYNAMIC(x, self._packed, self._reduce_range)
        rows = x.reshape(-1, self.in_features)
        y = self.int_mm(rows) if self.path == "int_mm" else self.fused_rows(rows)
        return y.reshape(*x.shape[:-1], self.out_features)

    def fused_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Each row scaled to an absolute maximum of 1, so the fused kernel's one range is every row's own."""
        peak = _row_peak(rows)
        y = _LINEAR_DYNAMIC(rows / peak, self._packed, self._reduce_range)
        return y * peak if self.bias is None else (y - self.bias) * peak + self.bias

    def int_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """Symmetric 8-bit rows times the int8 weights with torch._int_mm, rescaled per row and channel."""
        if self.w_t is None:
            self.set_path("int_mm")
        scale = _row_peak(rows) / 127
        q = torch.round(rows / scale).to(torch.int8)
        if int_mm_uses_onednn():
            acc = torch._int_mm(q, self.w_t)
        else:  # the generic kernel, as on a CPU without a oneDNN int8 primitive (starjar.cpu.kernels)
            acc = _without_onednn(torch._int_mm, q, self.w_t)
        y = acc.float() * (scale * self.w_scale)
        return y if self.bias is None else y + self.bias


_ONEDNN_SWITCH = threading.Lock()  # the switch is process-wide: two threads must not interleave save and restore


def _without_onednn(fn, *args):
    """fn(*args) with oneDNN off for this call only. (torch.backends.mkldnn.flags() would also reset its TF32
    setting and warn on every call.)"""
    with _ONEDNN_SWITCH:
        was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return fn(*args)
        finally:
            torch._C._set_mkldnn_enabled(was)


def _row_peak(rows: torch.Tensor) -> torch.Tensor:
    """Each row's absolute maximum (at least 1e-12), [rows, 1]. (vector_norm(inf) gives the same values but
    measured 2-5x slower on a 2-core AVX2 EPYC: 18 vs 5 us for 8 x 576, 33 vs 6 us for 16 x 576.)"""
    return rows.abs().amax(-1, keepdim=True).clamp_min_(1e-12)


def quantize_int8(model: torch.nn.Module, path: str | None = None, act_bits: int = 7) -> torch.nn.Module:
    """Every nn.Linear becomes an int8 linear: per-channel weight scales, per-row activation scales (CPU).

    path: the multi-row kernel (int_mm or fused); None takes the one starjar.cpu.kernels measured fastest on
    this machine for the model's own layer shapes (or STARJAR_INT8_KERNEL when set).
    act_bits: the fused kernel's activation range, 7 or 8 (see RowInt8Linear; int_mm's rows are 8-bit).
    """
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    path = forced_path() or path  # STARJAR_INT8_KERNEL wins over a recipe's choice
    if path is None:
        shapes = sorted({(m.in_features, m.out_features) for m in model.modules()
                         if isinstance(m, torch.nn.Linear) and m.out_features < WIDE})
        path = int8_path(tuple(shapes[:4])) if shapes else "fused"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices, once per load
        model = quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DynamicLinear):
                setattr(parent, name, RowInt8Linear(child, path, act_bits))
    return model


DEFAULT_SHAPES = ((576, 1536), (1536, 576))  # the default draft's layer shapes


def int8_path(shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES) -> str:
    """The int8 path for multi-row passes over these layer shapes on this machine (kernels.chosen_path)."""
    return chosen_path(shapes, time_paths)


def time_paths(shapes, rows: tuple[int, ...] = PROBE_ROWS, reps: int = 5) -> dict[str, float]:
    """Median time (ms) of each path over the given (in, out) shapes and row counts, summed."""
    torch.manual_seed(0)
    total = dict.fromkeys(INT8_PATHS, 0.0)
    for k, n in shapes:
        layer = RowInt8Linear(dynamic_int8(torch.nn.Linear(k, n, bias=False)))
        for m in rows:
            x = torch.randn(m, k)
            for path in INT8_PATHS:
                fn = layer.int_mm if path == "int_mm" else layer.fused_rows
                fn(x)  # warm-up (packing, thread pool)
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn(x)
                    ts.append(time.perf_counter() - t0)
                total[path] += sorted(ts)[len(ts) // 2] * 1000
    return total
