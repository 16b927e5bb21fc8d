"""Attention for starjar's ragged passes: grouped-query heads folded onto their KV head, no copies of K and V.

Hugging Face's sdpa path copies K and V once per query head of a group (`repeat_kv`) in every layer of
every pass with more than one query token: at batch 16 x 4 positions over 512 tokens of context that is
20 ms per layer on a 2-core CPU, against 1 ms here. Instead the g query heads that share a KV head are
laid along the query axis of that head ([B, Hkv*g, Q, D] -> [B, Hkv, g*Q, D], a view), and the [B, 1, Q, K]
mask is repeated g times along the query axis (once per pass, a few KB), so one SDPA call per layer reads
K and V where the cache keeps them.

Padding to the longest context stays: attending row by row over each row's own keys (no padding read)
measured 9-21% slower per pass at 4-8 ragged rows (64..512 tokens) on a 2-core AVX2 CPU, the loop's calls
costing more than the padding's reads.

The function computed is the same attention: only the order of floating-point reductions can differ
(max |difference| about 2e-7 on unit-scale inputs). Registered as the attention implementation "starjar";
`benchmarks.fixtures.reference` switches a model back to stock sdpa for the target-alone reference.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

NAME = "starjar"
_folded: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # one pass's folded mask, reused by every layer


def folded_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, Q, D], key/value [B, Hkv, K, D], mask [B, 1, Q, K] additive or boolean (or None: causal
    when Q == K, else none). Returns [B, Q, H, D] as the attention interface expects."""
    b, h, q, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    if query.stride(-1) != 1:
        # A query whose last dim is strided (the rotary output of a one-token step is) sends SDPA to its math
        # path, which scales a copy of K per layer: at 64 rows x 4k keys 4.4x slower and +31 MiB per call.
        query = query.contiguous()
    if attention_mask is None:
        causal = q > 1 and q == key.shape[2] and (is_causal if is_causal is not None else True)
        if g > 1:
            # A causal mask cannot be folded as a flag: build it (prefill without a cache only).
            mask = None if not causal else torch.ones(q, key.shape[2], dtype=torch.bool,
                                                      device=query.device).tril()
            out = _fold_sdpa(query, key, value, mask, g, scaling)
        else:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if g == 1:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return _fold_sdpa(query, key, value, attention_mask, g, scaling).transpose(1, 2).contiguous(), None


def _fold_sdpa(query, key, value, mask, g: int, scaling) -> torch.Tensor:
    b, h, q, d = query.shape
    qf = query.reshape(b, h // g, g * q, d)  # heads kv*g + r -> kv head, query rows r*Q + t
    if mask is not None and q > 1:
        mask = fold_mask(mask, g)
    out = F.scaled_dot_product_attention(qf, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, q, d)


def fold_mask(mask: torch.Tensor, g: int) -> torch.Tensor:
    """[..., Q, K] -> [..., g*Q, K] (row r*Q + t is query t's), computed once per pass and mask object."""
    hit = _folded.get(g)
    if hit is not None and hit[0]() is mask:
        return hit[2]
    lead = mask.shape[:-2]
    q, k = mask.shape[-2:]
    folded = mask.unsqueeze(-3).expand(*lead, g, q, k).reshape(*lead, g * q, k)
    _folded[g] = (weakref.ref(mask), g, folded)
    # The entry lives as long as its pass's mask, not until the next pass: a folded mask is g x [B, Q, K] floats
    # (measured on the draft server: 74 MiB kept after a 13-row catch-up pass over 4k tokens of context).
    weakref.finalize(mask, _forget, g, folded)
    return folded


def _forget(g: int, folded: torch.Tensor) -> None:
    hit = _folded.get(g)
    if hit is not None and hit[2] is folded:  # finalizers run on whichever thread drops the mask: never raise
        _folded.pop(g, None)


def install(model: torch.nn.Module) -> bool:
    """Make `model` attend with folded_attention (False if the model cannot take a custom implementation)."""
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError, NotImplementedError):
        return False
    return True


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, folded_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def stock_attention(model: torch.nn.Module, name: str = "sdpa"):
    """Run `model` with Hugging Face's own attention for a while (the target-alone reference)."""
    before = getattr(model.config, "_attn_implementation", None)
    if before != NAME:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
