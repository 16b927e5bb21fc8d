"""A float Llama-family target's decoder layer compiled by TorchScript, every value as Hugging Face computes it.

A target's logits must be Hugging Face's own to the last bit (greedy output is the target decoding alone), so
no sum is reordered: RMSNorm goes through float32 and back as LlamaRMSNorm does, the rotation computes HF's
products and sums, attention is starjar.model.attention.folded_attention's (the target's attention
implementation) with the same query layout and scale, and every linear takes the product
starjar.cpu.skinny_linear installed on the model for the pass's row count (F.linear, W @ x.T or MKL's packed
sgemm; PATHS). Only the Python between the ops goes: HF's module calls, hooks and keyword plumbing, and the
cache's update() per layer (K and V are written in place through RaggedKVCache.pass_views, as
starjar.model.lean_step writes them).

The _fused_ layers take fewer ops for the same bits: q, k and v as one product over their concatenated weights
(and gate and up likewise; starjar.model.fused_projections checks on the running machine that this changes no
bit), q and k rotated in one go with rotate_half as a gather, and the one-row step runs every layer in one
call. Measured on the default target (Intel Xeon, AVX512, 2 threads): a batch-1 step 35.1 -> 29.6 ms. The
unfused layers stay for models whose concatenated products would differ.

Per pass shape class: the one-row one-token step (every linear is F.linear's GEMV, K and V written at one
position of the row's buffers) and any other chain pass (several rows, several tokens, or both; the padded
[B, Q] layout HF sees, so each linear gets the rows HF's would).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from starjar.model.lean_step import write_read
from starjar.model.scripting import scripted

PATHS = {"linear": 0, "wxt": 1, "packed": 2, "rows": 3}  # skinny_linear's path names -> the layers' codes
OWN = 3  # starjar's own few-rows product: the native pass calls it; the scripted layers cannot


def hf_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm (Qwen2's and Mistral's are the same): in float32, back to x's dtype, then the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's apply_rotary_pos_emb for one tensor: x [B, H, Q, D], cos and sin [B, 1, Q, D]."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _linear(x: Tensor, w: Tensor, b: Tensor | None, path: int, packed: Tensor | None) -> Tensor:
    """skinny_linear._few_rows_forward's product for `path` (0 F.linear, 1 W @ x.T, 2 MKL packed)."""
    if path == 0:
        return F.linear(x, w, b)
    if path == 3:
        raise RuntimeError("the few-rows product (path 3) runs in the native pass only")
    k = x.shape[-1]
    rows = x.numel() // k
    shape = x.shape[:-1] + [w.shape[0]]
    if path == 2 and packed is not None:
        return torch.ops.mkl._mkl_linear(x.reshape(rows, k).contiguous(), packed, w, b, rows).reshape(shape)
    out = w.matmul(x.reshape(rows, k).t()).t()  # torch.matmul's op; the method is never looked up in Python
    if b is not None:
        out = out + b
    return out.reshape(shape)


def _attend(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, nq: int, nk: int, d: int,
            scaling: float) -> Tensor:
    """folded_attention with a mask (already folded where it folds one): query [B, H, Q, D] -> [B, Q, H*D]."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    b, q = query.shape[0], query.shape[2]
    g = nq // nk
    if g == 1:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query.reshape(b, nk, g * q, d), keys, values, attn_mask=mask,
                                             scale=scaling).reshape(b, nq, q, d)
    return out.transpose(1, 2).contiguous().reshape(b, q, -1).contiguous()


def _step_layer(x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, ws: list[Tensor], bs: list[Tensor | None],
                keys: Tensor, values: Tensor, start: int, kv_len: int, nq: int, nk: int, d: int, eps: float,
                scaling: float) -> Tensor:
    """One row, one token: x [1, 1, hidden]; keys/values [1, Hkv, L, D], the row's buffers, written at start.
    ws: input norm, q, k, v, o, post norm, gate, up, down weights; bs: the seven linears' biases (or None)."""
    h = hf_rms_norm(x, ws[0], eps)
    qs = F.linear(h, ws[1], bs[0]).view(1, 1, -1, d).transpose(1, 2)
    ks = F.linear(h, ws[2], bs[1]).view(1, 1, -1, d).transpose(1, 2)
    vs = F.linear(h, ws[3], bs[2]).view(1, 1, -1, d).transpose(1, 2)
    qs, ks = _rotate(qs, cos, sin), _rotate(ks, cos, sin)
    keys[:, :, start:start + 1] = ks
    values[:, :, start:start + 1] = vs
    att = _attend(qs, keys[:, :, :kv_len], values[:, :, :kv_len], mask, nq, nk, d, scaling)
    x = x + F.linear(att, ws[4], bs[3])
    h = hf_rms_norm(x, ws[5], eps)
    return x + F.linear(F.silu(F.linear(h, ws[6], bs[4])) * F.linear(h, ws[7], bs[5]), ws[8], bs[6])


def _rows_layer(x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, ws: list[Tensor], bs: list[Tensor | None],
                packs: list[Tensor | None], paths: list[int], keys: Tensor, values: Tensor, rows: Tensor | None,
                write: Tensor | None, start: int, kv_len: int, nq: int, nk: int, d: int, eps: float,
                scaling: float) -> Tensor:
    """Any chain pass: x [B, Q, hidden] (padded as HF's); keys, values, rows, write, start, kv_len as
    lean_step.write_read's; mask [B, 1, Q, K], folded when folded_attention folds it (grouped heads, Q > 1);
    paths: the seven linears' products for B x Q rows (PATHS), packs their packed weights where that is 2 (else
    None); ws, bs as _step_layer's."""
    b, q = x.shape[0], x.shape[1]
    h = hf_rms_norm(x, ws[0], eps)
    qs = _linear(h, ws[1], bs[0], paths[0], packs[0]).view(b, q, -1, d).transpose(1, 2)
    ks = _linear(h, ws[2], bs[1], paths[1], packs[1]).view(b, q, -1, d).transpose(1, 2)
    vs = _linear(h, ws[3], bs[2], paths[2], packs[2]).view(b, q, -1, d).transpose(1, 2)
    qs, ks = _rotate(qs, cos, sin), _rotate(ks, cos, sin)
    k_att, v_att = write_read(keys, values, ks, vs, rows, write, start, kv_len)
    att = _attend(qs, k_att, v_att, mask, nq, nk, d, scaling)
    x = x + _linear(att, ws[4], bs[3], paths[3], packs[3])
    h = hf_rms_norm(x, ws[5], eps)
    gate = _linear(h, ws[6], bs[4], paths[4], packs[4])
    up = _linear(h, ws[7], bs[5], paths[5], packs[5])
    return x + _linear(F.silu(gate) * up, ws[8], bs[6], paths[6], packs[6])



def _fused_step_layer(x: Tensor, cos: Tensor, sin_signed: Tensor, perm: Tensor, mask: Tensor, ws: list[Tensor],
                      bs: list[Tensor | None], keys: Tensor, values: Tensor, start: int, kv_len: int, nq: int,
                      nk: int, d: int, eps: float, scaling: float) -> Tensor:
    """_step_layer over fused projections (starjar.model.fused_projections), every value bit for bit its own:
    ws: input norm, qkv, o, post norm, gate-up, down weights; bs: the four products' biases. q and k rotate in
    one go, HF's rotate_half as a gather by perm with its sign folded into sin_signed (x * -s == -x * s)."""
    h = hf_rms_norm(x, ws[0], eps)
    heads = F.linear(h, ws[1], bs[0]).view(1, 1, -1, d).transpose(1, 2)  # [1, nq + 2 nk, 1, d]
    qk = heads.narrow(1, 0, nq + nk)
    qk = qk * cos + qk.index_select(-1, perm) * sin_signed
    keys.narrow(2, start, 1).copy_(qk.narrow(1, nq, nk))
    values.narrow(2, start, 1).copy_(heads.narrow(1, nq + nk, nk))
    att = _attend(qk.narrow(1, 0, nq), keys.narrow(2, 0, kv_len), values.narrow(2, 0, kv_len), mask, nq, nk, d,
                  scaling)
    x = x + F.linear(att, ws[2], bs[1])
    h = hf_rms_norm(x, ws[3], eps)
    gate_up = F.linear(h, ws[4], bs[2])
    inner = gate_up.shape[-1] // 2
    return x + F.linear(F.silu(gate_up.narrow(-1, 0, inner)) * gate_up.narrow(-1, inner, inner), ws[5], bs[3])


def _fused_step(x: Tensor, cos: Tensor, sin_signed: Tensor, perm: Tensor, mask: Tensor, ws: list[list[Tensor]],
                bs: list[list[Tensor | None]], keys: list[Tensor], values: list[Tensor], start: int, kv_len: int,
                nq: list[int], nk: list[int], d: int, eps: float, scaling: float) -> Tensor:
    """Every layer's fused step in one call: no Python between layers."""
    for i in range(len(ws)):
        x = _fused_step_layer(x, cos, sin_signed, perm, mask, ws[i], bs[i], keys[i], values[i], start, kv_len,
                              nq[i], nk[i], d, eps, scaling)
    return x


def _fused_rows_layer(x: Tensor, cos: Tensor, sin_signed: Tensor, perm: Tensor, mask: Tensor, ws: list[Tensor],
                      bs: list[Tensor | None], packs: list[Tensor | None], paths: list[int], keys: Tensor,
                      values: Tensor, rows: Tensor | None, write: Tensor | None, start: int, kv_len: int, nq: int,
                      nk: int, d: int, eps: float, scaling: float) -> Tensor:
    """_rows_layer over fused projections, as _fused_step_layer is _step_layer's: ws, bs as there; paths and
    packs for the four products (qkv, o, gate-up, down) as _rows_layer's are for seven."""
    b, q = x.shape[0], x.shape[1]
    h = hf_rms_norm(x, ws[0], eps)
    heads = _linear(h, ws[1], bs[0], paths[0], packs[0]).view(b, q, -1, d).transpose(1, 2)
    qk = heads.narrow(1, 0, nq + nk)
    qk = qk * cos + qk.index_select(-1, perm) * sin_signed
    k_att, v_att = write_read(keys, values, qk.narrow(1, nq, nk), heads.narrow(1, nq + nk, nk), rows, write,
                              start, kv_len)
    att = _attend(qk.narrow(1, 0, nq), k_att, v_att, mask, nq, nk, d, scaling)
    x = x + _linear(att, ws[2], bs[1], paths[1], packs[1])
    h = hf_rms_norm(x, ws[3], eps)
    gate_up = _linear(h, ws[4], bs[2], paths[2], packs[2])
    inner = gate_up.shape[-1] // 2
    return x + _linear(F.silu(gate_up.narrow(-1, 0, inner)) * gate_up.narrow(-1, inner, inner), ws[5], bs[3],
                       paths[3], packs[3])


def step_fn() -> torch.jit.ScriptFunction:
    """The scripted one-row one-token layer (compiled once per process, about 0.2 s)."""
    return scripted(_step_layer)


def rows_fn() -> torch.jit.ScriptFunction:
    """The scripted layer for every other chain pass."""
    return scripted(_rows_layer)


def fused_step_fn() -> torch.jit.ScriptFunction:
    """The scripted one-row one-token pass over all layers' fused projections."""
    return scripted(_fused_step)


def fused_rows_fn() -> torch.jit.ScriptFunction:
    """The scripted layer for every other chain pass over fused projections."""
    return scripted(_fused_rows_layer)
