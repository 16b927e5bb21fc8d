"""Whether a co-located draft may start from the target's prompt KV instead of prefilling the prompt itself.

An int8 copy of the target has the target's layers, heads and rotary embedding, so the keys and values the
target's prefill wrote are what the copy's own prefill approximates (to its int8 rounding). Taking them costs a
copy, where the copy's own prefill cost 0.7-1.0x the target's (a 700-token prompt: 1.14 s against 1.58 s on a
2-core AMD EPYC, AVX2), which on prompt-heavy workloads ate what speculation saved in decoding. The draft only
proposes: whatever KV it reads, the target verifies every token. A smoothed copy's values are the float
model's divided per channel (starjar.model.smoothing), so the target's are divided so too. Only in process:
over the wire the KV of one prompt (tens of MB) would cost more than the prefill it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

from starjar.model.loading import LoadedModel

_SHAPE = ("num_hidden_layers", "num_key_value_heads", "num_attention_heads", "hidden_size", "head_dim",
          "rope_theta", "rope_scaling", "max_position_embeddings")


def prompt_kv_shared(target: LoadedModel, draft: LoadedModel) -> bool:
    """True when `draft` is an int8 copy of `target`'s own weights, every layer kept, reading whole prompts,
    on the same device: then the target's prompt KV stands in for the draft's prefill."""
    if draft.weights_from is None or Path(draft.weights_from) != Path(target.path).resolve():
        return False
    if draft.lean is None or draft.lean.skipped or draft.prompt_window is not None or draft.device != target.device:
        return False
    t, d = target.model.config, draft.model.config
    return all(getattr(t, k, None) == getattr(d, k, None) for k in _SHAPE)


def seeder(draft: LoadedModel, seed: Callable[[Hashable, Sequence[int], list], bool]):
    """target_worker.prompt_ahead's SeedDraft for a draft engine's seed(): the target's per-layer (K, V) put in
    the draft's terms first (its smoothed values)."""
    scales = draft.value_scales

    def seed_with_target_kv(key: Hashable, tokens: Sequence[int], layers: list) -> bool:
        if scales is not None:
            layers = [(k, v / s[:, None, :]) for (k, v), s in zip(layers, scales, strict=True)]
        return seed(key, tokens, layers)

    return seed_with_target_kv
