"""Int8 draft directories as `starjar models build` writes them, made from a tiny target."""

from __future__ import annotations

import json
import shutil


def int8_draft_dir(tmp_path, target_dir, **recipe):
    """A draft directory as `starjar models build` writes it: tokenizer and config, weights from the target."""
    d = tmp_path / "int8-draft"
    shutil.copytree(target_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    (d / "starjar.json").write_text(json.dumps({"kind": "dynamic-int8", "weights_from": str(target_dir), **recipe}))
    return d


def with_random_biases(tmp_path, target_dir):
    """A copy of a target whose biases (Qwen2's q/k/v) are not zero: a freshly made tiny model's are, which would
    hide a bias handled wrongly."""
    import torch
    from transformers import AutoModelForCausalLM

    d = tmp_path / "biased"
    shutil.copytree(target_dir, d)
    model = AutoModelForCausalLM.from_pretrained(d)
    gen = torch.Generator().manual_seed(0)
    biases = [p for name, p in model.named_parameters() if name.endswith(".bias")]
    assert biases
    with torch.no_grad():
        for p in biases:
            p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(d)
    return d


def prefilled(model, ids):
    """A new cache of `model` holding `ids` (one pass over them): (the cache, its slot)."""
    cache = model.new_cache()
    slot = cache.allocate()
    model.forward(cache, [slot], [ids], [[len(ids) - 1]])
    return cache, slot
