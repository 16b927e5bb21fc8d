"""The int8 draft's layers compiled by TorchScript: the one-row one-token step, and multi-row passes.

Measured on a 2-core AMD EPYC (AVX2) for the default pair's int8 draft: a one-token step took 21.4 ms in the
eager lean forward, of which its 121 int8 linears were 10.4 ms; the rest was the ~50 small ops per layer,
each paying Python and dispatch. Run as one scripted function per layer the step takes 17.4 ms (26.3 -> 21.9 ms
at one thread), with logits bit-identical to the eager forward: the same ops in the same order, only the
Python between them goes. (torch.compile of the same glue measured slower, 27.9 ms: its per-call guards cost
more than the ops they replace.)

A pass over several rows or tokens (batched drafting, a catch-up, a prefill into existing buffers) pays more
glue per layer: each int8 linear scales its rows to their own range first (starjar.cpu.quantized). Scripted the same
way (same machine, 2 threads, eager -> scripted): a 4-row step 30.2 -> 18.6 ms, an 8-row step 35.6 -> 24.2 ms,
a one-row 2-token catch-up 27.1 -> 16.4 ms, again bit-identical.

The one-row one-token step runs torch's dynamic int8 kernel as is (one range per tensor is the row's own); the
multi-row layer runs the path starjar.cpu.kernels chose for this machine, `fused` or `int_mm` (only int_mm's generic
kernel, STARJAR_INT_MM_ONEDNN=0, keeps the eager forward: it is switched per call, which scripting cannot). Rows
on consecutive cache slots are written through views of their buffers, others through the whole buffers and then
gathered, as RaggedKVCache.update does; tree passes and float drafts keep the eager forward. STARJAR_LEAN_SCRIPT=0
turns both off (to compare, or to force the eager path).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from starjar.model.scripting import scripted


def enabled() -> bool:
    return os.environ.get("STARJAR_LEAN_SCRIPT", "1") != "0"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm spelled out (the same ops as Hugging Face's): 19 vs 27 us for F.rms_norm on one 576-wide row
    (2-core AVX2 EPYC), whose CPU path is a composite of more ops; 61 norms a draft step. The eager lean forward
    calls this same function, so the two paths stay bit-identical."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _layer(x: Tensor, cos: Tensor, sin: Tensor, w_in: Tensor, qkv: torch.classes.quantized.LinearPackedParamsBase,
           o: torch.classes.quantized.LinearPackedParamsBase, w_post: Tensor,
           gate_up: torch.classes.quantized.LinearPackedParamsBase,
           down: torch.classes.quantized.LinearPackedParamsBase, reduce_range: bool, keys: Tensor, values: Tensor,
           start: int, nq: int, nk: int, head_dim: int, eps: float) -> Tensor:
    """x [1, 1, hidden]; keys/values [1, Hkv, L, D] (the row's cache buffers, written at `start`)."""
    heads = torch.ops.quantized.linear_dynamic(rms_norm(x, w_in, eps), qkv, reduce_range)
    heads = heads.view(1, 1, -1, head_dim)
    qk = heads[:, :, : nq + nk]
    half = head_dim // 2
    qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin  # as lean_decoder._rope
    keys[:, :, start:start + 1] = qk[:, :, nq:].transpose(1, 2)
    values[:, :, start:start + 1] = heads[:, :, nq + nk:].transpose(1, 2)
    # The group's query heads laid along the query axis of their KV head (starjar.model.attention's fold); the
    # default scale, as the eager lean forward uses.
    query = qk[:, :, :nq].transpose(1, 2).contiguous().reshape(1, nk, nq // nk, head_dim)
    att = _attend(query, keys[:, :, :start + 1], values[:, :, :start + 1], None)
    x = x + torch.ops.quantized.linear_dynamic(att.reshape(1, 1, -1), o, reduce_range)
    gate, up = torch.ops.quantized.linear_dynamic(rms_norm(x, w_post, eps), gate_up, reduce_range).chunk(2, -1)
    return x + torch.ops.quantized.linear_dynamic(F.silu(gate) * up, down, reduce_range)


def _attend(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """SDPA in the cache's precision, the result in the query's (starjar.model.kv_precision); a float32 cache pays no
    conversion call, which the one-token step would pay 60 times."""
    if keys.dtype == query.dtype:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
    return F.scaled_dot_product_attention(query.to(keys.dtype), keys, values, attn_mask=mask).to(query.dtype)



def layer_fn():
    """The scripted one-row one-token layer."""
    return scripted(_layer)


def _rows_linear(x: Tensor, packed: torch.classes.quantized.LinearPackedParamsBase, reduce_range: bool,
                 bias: Tensor | None, w_t: Tensor | None, w_scale: Tensor | None) -> Tensor:
    """starjar.cpu.quantized.RowInt8Linear's multi-row paths, the same ops. w_t None (fused_rows): each row scaled to
    an absolute maximum of 1 first, so the kernel's one activation range is every row's own, and the packed bias,
    scaled with the row, put right. w_t and w_scale given (int_mm): rows quantized symmetrically to 8 bits and
    multiplied with torch._int_mm (oneDNN's VNNI/AMX kernel; the generic one is never scripted)."""
    rows = x.reshape(-1, x.shape[-1])
    peak = rows.abs().amax(-1, keepdim=True).clamp_min_(1e-12)  # as quantized._row_peak
    if w_t is not None and w_scale is not None:
        scale = peak / 127
        acc = torch._int_mm(torch.round(rows / scale).to(torch.int8), w_t)
        y = acc.float() * (scale * w_scale)
        if bias is not None:
            y = y + bias
    else:
        y = torch.ops.quantized.linear_dynamic(rows / peak, packed, reduce_range)
        y = y * peak if bias is None else (y - bias) * peak + bias
    return y.reshape(x.shape[0], x.shape[1], -1)


def write_read(keys: Tensor, values: Tensor, ks: Tensor, vs: Tensor, rows: Tensor | None, write: Tensor | None,
                start: int, kv_len: int) -> tuple[Tensor, Tensor]:
    """As RaggedKVCache.update: write a pass's ks/vs [B, Hkv, Q, D], return the keys and values to attend. rows [B]
    (scattered slots): keys/values are the whole buffers, written at write [B, Q], then gathered. rows None:
    keys/values are the rows' buffers [B, Hkv, L, D] (views), written at write or, when None, one span from
    `start`. The buffers may hold a lower precision than ks/vs (starjar.model.kv_precision)."""
    if keys.dtype != ks.dtype:  # a float16 cache; a float32 one pays no conversion call
        ks, vs = ks.to(keys.dtype), vs.to(values.dtype)
    if rows is not None:
        assert write is not None  # scattered slots never share one span (RaggedKVCache.begin)
        slots = rows[:, None].expand_as(write)
        keys[slots, :, write] = ks.transpose(1, 2)
        values[slots, :, write] = vs.transpose(1, 2)
        return keys[rows, :, :kv_len], values[rows, :, :kv_len]
    if write is None:
        keys[:, :, start:start + ks.shape[2]] = ks
        values[:, :, start:start + vs.shape[2]] = vs
    else:
        idx = write[:, None, :, None]
        keys.scatter_(2, idx.expand_as(ks), ks)
        values.scatter_(2, idx.expand_as(vs), vs)
    return keys[:, :, :kv_len], values[:, :, :kv_len]


def padded(t: Tensor, real: Tensor, b: int, q: int) -> Tensor:
    """A ragged pass's heads [T, 1, H, D] laid out padded [B, Q, H, D] for attention. A padding token's zero
    K and V land past its row's valid length, where no query looks (RaggedKVCache.begin)."""
    flat = t.reshape(t.shape[0], t.shape[2], t.shape[3])
    full = torch.zeros(b * q, flat.shape[1], flat.shape[2], dtype=t.dtype)
    return full.index_copy_(0, real, flat).view(b, q, flat.shape[1], flat.shape[2])


def _rows_layer(x: Tensor, cos: Tensor, sin: Tensor, w_in: Tensor, qkv: torch.classes.quantized.LinearPackedParamsBase,
                o: torch.classes.quantized.LinearPackedParamsBase, w_post: Tensor,
                gate_up: torch.classes.quantized.LinearPackedParamsBase,
                down: torch.classes.quantized.LinearPackedParamsBase, reduce_range: bool, keys: Tensor, values: Tensor,
                rows: Tensor | None, write: Tensor | None, start: int, kv_len: int, mask: Tensor, nq: int, nk: int,
                head_dim: int, eps: float, biases: list[Tensor | None], mats: list[Tensor | None], real: Tensor | None,
                b: int, q: int) -> Tensor:
    """x [B, Q, hidden], or with `real` only the pass's real tokens [T, 1, hidden] (real: their indices in the
    flattened B x Q; cos and sin likewise); keys, values, rows, write, start, kv_len: see write_read; mask
    [B, 1, Q, K] additive, already folded for Q > 1; biases: of qkv, o, gate_up and down (None where a linear
    has none); mats: their int_mm weights and scales, (w_t, w_scale) each, None on the fused path. Only attention
    sees the padded B x Q layout: every other op is per token."""
    heads = _rows_linear(rms_norm(x, w_in, eps), qkv, reduce_range, biases[0], mats[0], mats[1])
    heads = heads.view(heads.shape[0], heads.shape[1], -1, head_dim)
    half = head_dim // 2
    qk = heads[:, :, : nq + nk]
    qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
    qs, ks, vs = qk[:, :, :nq], qk[:, :, nq:], heads[:, :, nq + nk:]
    if real is not None:
        qs, ks, vs = padded(qs, real, b, q), padded(ks, real, b, q), padded(vs, real, b, q)
    k_att, v_att = write_read(keys, values, ks.transpose(1, 2), vs.transpose(1, 2), rows, write, start, kv_len)
    query = qs.transpose(1, 2).contiguous().reshape(b, nk, (nq // nk) * q, head_dim)
    att = _attend(query, k_att, v_att, mask)
    att = att.reshape(b, nq, q, head_dim).transpose(1, 2).contiguous().reshape(b, q, -1)
    if real is not None:
        att = att.reshape(b * q, 1, -1).index_select(0, real)
    x = x + _rows_linear(att, o, reduce_range, biases[1], mats[2], mats[3])
    gate, up = _rows_linear(rms_norm(x, w_post, eps), gate_up, reduce_range, biases[2], mats[4],
                           mats[5]).chunk(2, -1)
    return x + _rows_linear(F.silu(gate) * up, down, reduce_range, biases[3], mats[6], mats[7])


def rows_layer_fn():
    """The scripted multi-row layer (several rows, or several tokens of one row)."""
    return scripted(_rows_layer)
