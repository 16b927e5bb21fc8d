"""Whether a co-located draft may start from the target's prompt KV instead of prefilling the prompt itself.

An int8 copy of the target has the target's layers, heads and rotary embedding, so the keys and values the
target's prefill wrote are what the copy's own prefill approximates (to its int8 rounding). Taking them costs a
copy, where the copy's own prefill cost 0.7-1.0x the target's (a 700-token prompt: 1.14 s against 1.58 s on a
2-core AMD EPYC, AVX2), which on prompt-heavy workloads ate what speculation saved in decoding. The draft only
proposes: whatever KV it reads, the target verifies every token. A smoothed copy's values are the float
model's divided per channel (starjar.model.smoothing), so the target's are divided so too.

A remote draft server running such a copy takes them over the wire too (SequenceRound.prompt_kv, in float16,
about 23 KB a token for the default pair): where the draft server shares the target's cores, its own prefill
of every prompt ran on the cores the target decodes on. Whether the server's copy was made from the target's
weights is told by `weights_id`, which both sides compute from the float weights' files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch

from starjar.model.loading import LoadedModel

WIRE_DTYPE = torch.float16

_SHAPE = ("num_hidden_layers", "num_key_value_heads", "num_attention_heads", "hidden_size", "head_dim",
          "rope_theta", "rope_scaling", "max_position_embeddings")


def prompt_kv_shared(target: LoadedModel, draft: LoadedModel) -> bool:
    """True when `draft` is an int8 copy of `target`'s own weights, every layer kept, reading whole prompts,
    on the same device: then the target's prompt KV stands in for the draft's prefill."""
    if draft.weights_from is None or Path(draft.weights_from) != Path(target.path).resolve():
        return False
    if draft.lean is None or draft.lean.skipped or draft.prompt_window is not None or draft.device != target.device:
        return False
    return shares_attention(target, draft)


def shares_attention(a: LoadedModel, b: LoadedModel) -> bool:
    ta, tb = a.model.config, b.model.config
    return all(getattr(ta, k, None) == getattr(tb, k, None) for k in _SHAPE)


def weights_id(model_dir: str | Path) -> str:
    """Names a float model's weights: a hash of its safetensors files' names, sizes and headers (every
    tensor's name, dtype, shape and place). Two directories holding the same files get the same id on any
    machine; reading it costs a few KB, not the weights. Empty when the directory has no safetensors."""
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            size = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little") + fh.read(min(size, 1 << 24)))
    return h.hexdigest()[:32] if files else ""


def takes_prompt_kv(draft: LoadedModel) -> str:
    """The weights id a draft server advertises (Limits.prompt_kv_from): that of the float weights its int8
    copy was made from, where it may take a prompt's KV at all; else empty (it prefills prompts itself)."""
    if (draft.weights_from is None or draft.lean is None or draft.lean.skipped or draft.prompt_window is not None
            or draft.hidden_tap is not None):  # a tap (TIDE) trains on the draft's own passes
        return ""
    return weights_id(draft.weights_from)


def wire_bytes(draft_or_target: LoadedModel, tokens: int) -> int:
    """Bytes of `tokens` tokens' keys and values on the wire."""
    layers, heads, dim = _kv_shape(draft_or_target)
    return 2 * layers * heads * tokens * dim * WIRE_DTYPE.itemsize


def _kv_shape(model: LoadedModel) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model's cache."""
    cfg = model.model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, dim


def to_wire(layers: list, start: int, end: int) -> bytes:
    """Positions start..end of per-layer (K, V) [heads, n, dim] as SequenceRound.prompt_kv."""
    parts = [t[:, start:end].to(WIRE_DTYPE).reshape(-1) for kv in layers for t in kv]
    return torch.cat(parts).numpy().tobytes()


def from_wire(data: bytes, model: LoadedModel, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """SequenceRound.prompt_kv back as per-layer (K, V) [heads, tokens, dim] in the draft's terms (a smoothed
    copy's values divided as its own are); None when the bytes are not `tokens` tokens' worth or hold a value
    that is not finite."""
    if tokens < 1 or len(data) != wire_bytes(model, tokens):
        return None
    layers, heads, dim = _kv_shape(model)
    flat = torch.frombuffer(bytearray(data), dtype=WIRE_DTYPE).float()
    if not bool(torch.isfinite(flat).all()):
        return None
    kv = flat.view(layers, 2, heads, tokens, dim)
    scales = model.value_scales
    return [(kv[i, 0], kv[i, 1] / scales[i][:, None, :] if scales is not None else kv[i, 1]) for i in range(layers)]


def seeder(draft: LoadedModel, seed: Callable[[Hashable, Sequence[int], list], bool]):
    """target_worker.prompt_ahead's SeedDraft for a draft engine's seed(): the target's per-layer (K, V) put in
    the draft's terms first (its smoothed values)."""
    scales = draft.value_scales

    def seed_with_target_kv(key: Hashable, tokens: Sequence[int], layers: list) -> int:
        if scales is not None:
            layers = [(k, v / s[:, None, :]) for (k, v), s in zip(layers, scales, strict=True)]
        return len(tokens) if seed(key, tokens, layers) else 0

    return seed_with_target_kv
