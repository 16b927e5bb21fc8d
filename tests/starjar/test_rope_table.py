"""Rotary cos and sin from a table (starjar.model.rope_table): the rotary module's bits, or not used."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from benchmarks.fixtures.tiny_models import make_tiny_model
from starjar.model import lean_target
from starjar.model.loading import load_model
from starjar.model.rope_table import FIRST, RopeTable


def _rotary(head_dim: int, **rope) -> LlamaRotaryEmbedding:
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=4096, **rope)
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("positions", [[list(range(10))], [[5], [900]], [[FIRST + 700, FIRST + 701]]])
def test_table_rows_are_the_modules_bits(positions):
    rotary = _rotary(64)
    table = RopeTable(rotary, 64)
    x = torch.zeros(1, 1, 256)
    ids = torch.tensor(positions)
    cos, sin, signed = table.lookup(x, ids)  # the last case grows the table past its first length
    want_cos, want_sin = rotary(x, position_ids=ids)
    assert torch.equal(cos, want_cos.unsqueeze(1)) and torch.equal(sin, want_sin.unsqueeze(1))
    assert torch.equal(signed, torch.cat((-sin[..., :32], sin[..., 32:]), dim=-1))


@pytest.mark.parametrize("head_dim,rope", [(16, {}), (64, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})])
def test_no_table_where_its_rows_may_differ(head_dim, rope):
    """A head too short to stay in ATen's vector loops; frequencies that follow the sequence length."""
    table = RopeTable(_rotary(head_dim, **rope), head_dim)
    assert table.lookup(torch.zeros(1, 1, 4 * head_dim), torch.tensor([[3]])) is None


def test_lean_passes_with_the_table_keep_hfs_bits(tmp_path, model_dirs, prompt_ids, monkeypatch):
    model = load_model(make_tiny_model(tmp_path / "wide", "llama", seed=4, hidden=128,
                                       tokenizer_from=model_dirs["llama"]))  # head_dim 32
    prompts = [p[:40] for p in prompt_ids[:3]]

    def passes():
        cache = model.new_cache()
        slots = [cache.allocate() for _ in prompts]
        out = model.forward(cache, slots, prompts, [list(range(len(p))) for p in prompts])
        for tok in (5, 9, 14):
            out += model.forward(cache, slots[:1], [[tok]], [[0]])
        return out + model.forward(cache, slots, [[7, 8]] * 3, [[0, 1]] * 3)

    monkeypatch.setenv(lean_target.ENV, "0")
    hf = passes()
    monkeypatch.setenv(lean_target.ENV, "1")
    for a, b in zip(hf, passes(), strict=True):
        assert torch.equal(a, b)
    assert model.lean_target._rope_table._tables  # the lean passes took the table
