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
from dataclasses import dataclass, field

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
    # In float32, where the bits are checked the same (tests/starjar/test_kernels.py).
    chunks = key_chunks(attention_mask, key.shape[2]) if query.dtype == torch.float32 else None
    if chunks is None:
        return _attend(query, key, value, attention_mask, g, scaling).transpose(1, 2).contiguous(), None
    out = query.new_empty(b, h, q, d)
    for chunk in chunks:  # a long pass: each chunk of query rows over the key blocks they may see
        m0, m1, keys = chunk.rows.start, chunk.rows.stop, chunk.keys
        out[:, :, m0:m1] = _attend(query[:, :, m0:m1], key[:, :, :keys], value[:, :, :keys],
                                   attention_mask[:, :, m0:m1, :keys], g, scaling, chunk.folded)
    return out.transpose(1, 2).contiguous(), None


def _attend(query, key, value, mask, g: int, scaling, folded: dict | None = None) -> torch.Tensor:
    if g == 1:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return _fold_sdpa(query, key, value, mask, g, scaling, folded)


def _fold_sdpa(query, key, value, mask, g: int, scaling, folded: dict | None = None) -> torch.Tensor:
    """folded: where given, the mask folded per g is kept there (a chunk's), not in the one-pass cache."""
    b, h, q, d = query.shape
    qf = query.reshape(b, h // g, g * q, d)  # heads kv*g + r -> kv head, query rows r*Q + t
    if mask is not None and q > 1:
        if folded is None:
            mask = fold_mask(mask, g)
        else:
            if g not in folded:
                lead = mask.shape[:-2]
                folded[g] = mask.unsqueeze(-3).expand(*lead, g, *mask.shape[-2:]).reshape(*lead, g * q, mask.shape[-1])
            mask = folded[g]
    out = F.scaled_dot_product_attention(qf, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, q, d)


# A long pass attends in chunks of query rows, each over the keys its rows may see rounded up to whole blocks of
# the CPU flash kernel: it sums a row's keys in blocks of FLASH_KV_BLOCK whatever the queries are, and a block no
# row of a chunk may see adds exact zeros, so leaving it out changes no bit (tests/starjar/test_kernels.py checks
# that on the running machine). starjar/model/native/pass_parts.h does the same for the native passes.
FLASH_KV_BLOCK = 512  # ATen's kv_split_size for the CPU flash kernel
CHUNK_ROWS = 128  # query rows a chunk's extent is read for


@dataclass
class Chunk:
    rows: range  # query rows
    keys: int  # keys [0, keys) they attend
    # Their rows of the pass's mask folded, per g: copies (a view would keep the pass's mask alive).
    folded: dict = field(default_factory=dict)


_chunked: dict[str, tuple[weakref.ref, list[Chunk] | None]] = {}  # one pass's chunks, reused by every layer


def key_chunks(mask: torch.Tensor | None, k: int) -> list[Chunk] | None:
    """The chunks of a pass with this mask [B, 1, Q, K] (additive or boolean) over k keys, None where no key block
    can be left out (then the pass attends in one call). Worked out once per pass and mask object."""
    if mask is None or mask.dim() != 4 or mask.shape[-2] <= 1 or k <= FLASH_KV_BLOCK or mask.shape[-1] != k \
            or mask.device.type != "cpu":
        return None
    hit = _chunked.get("pass")
    if hit is not None and hit[0]() is mask:
        return hit[1]
    seen = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2  # [B, Q, K]
    last = (k - seen.flip(-1).to(torch.uint8).argmax(-1)).amax(0)  # [Q]: a row may see keys before this
    chunks: list[Chunk] = []
    q = mask.shape[-2]
    for m0 in range(0, q, CHUNK_ROWS):
        m1 = min(q, m0 + CHUNK_ROWS)
        keys = min(k, -(-int(last[m0:m1].max()) // FLASH_KV_BLOCK) * FLASH_KV_BLOCK)
        if chunks and chunks[-1].keys == keys:
            chunks[-1].rows = range(chunks[-1].rows.start, m1)
        else:
            chunks.append(Chunk(range(m0, m1), keys))
    plan = None if len(chunks) == 1 else chunks
    entry = (weakref.ref(mask), plan)
    _chunked["pass"] = entry
    weakref.finalize(mask, _forget_chunks, entry)  # the plan and its folded masks go with the pass's mask
    return plan


def _forget_chunks(entry: tuple) -> None:
    if _chunked.get("pass") is entry:  # a later pass's plan stays
        _chunked.pop("pass", None)


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
