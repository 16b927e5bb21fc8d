"""A float model's weights moved into one huge-page block (starjar.cpu.huge_pages): the same values, the
fused projections views of it, and the block advised for huge pages."""

import re
from pathlib import Path

import pytest
import torch

from controller.colocated import colocated_engine
from starjar.cpu import huge_pages
from starjar.model import fused_projections, lean_target
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


def _logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    cache = model.new_cache()
    slots = [cache.allocate() for _ in prompts]
    out = model.forward(cache, slots, prompts, [list(range(len(p))) for p in prompts])
    for tok in (5, 9, 14):
        out += model.forward(cache, slots[:1], [[tok]], [[0]])
    return out


def _mapping_flags(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address ptr."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if inside:
                break
            inside = int(span.group(1), 16) <= ptr < int(span.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_moved_weights_keep_their_values_and_the_greedy_tokens(model_dirs, prompt_ids, monkeypatch, family):
    """The same values; the moved model's passes equal its own HF forward's bits (MKL's last bits may follow
    the weights' alignment, which the file mapping leaves arbitrary), and its greedy tokens the loaded one's."""
    monkeypatch.setenv(huge_pages.ENV, "0")
    loaded = load_model(model_dirs[family])
    monkeypatch.setenv(huge_pages.ENV, "1")
    moved = load_model(model_dirs[family])
    assert {n: p.data_ptr() for n, p in moved.model.named_parameters()} != \
        {n: p.data_ptr() for n, p in loaded.model.named_parameters()}
    for name, p in loaded.model.named_parameters():
        assert torch.equal(p, moved.model.get_parameter(name)), name
    prompts = prompt_ids[:3]
    monkeypatch.setenv(lean_target.ENV, "0")
    hf = _logits(moved, prompts)
    monkeypatch.setenv(lean_target.ENV, "1")
    for a, b in zip(hf, _logits(moved, prompts), strict=True):
        assert torch.equal(a, b)
    params = SamplingParams(max_tokens=16)
    assert [r.output_ids for r in colocated_engine(moved, None, 0, 4).generate(prompts, params)] == \
        [r.output_ids for r in colocated_engine(loaded, None, 0, 4).generate(prompts, params)]
    head, embed = moved.model.get_output_embeddings(), moved.model.get_input_embeddings()
    if moved.model.config.tie_word_embeddings:
        assert head.weight is embed.weight  # tied parameters stay one


def test_the_fused_projections_are_views_of_the_moved_weights(model_dirs, monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "1")
    model = load_model(model_dirs["qwen2"])  # biased q/k/v: the biases lie back to back too
    layer = model.model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    qkv, bias = fused_projections._concat([attn.q_proj, attn.k_proj, attn.v_proj])
    assert qkv.data_ptr() == attn.q_proj.weight.data_ptr() and bias.data_ptr() == attn.q_proj.bias.data_ptr()
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    gate_up, _ = fused_projections._concat([mlp.gate_proj, mlp.up_proj])
    assert gate_up.data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert torch.equal(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    # Where they are not back to back, a copy.
    assert huge_pages.adjacent([attn.k_proj.weight, attn.q_proj.weight]) is None
    assert fused_projections._concat([attn.k_proj, attn.q_proj])[0].data_ptr() != attn.k_proj.weight.data_ptr()


def test_the_block_is_advised_for_huge_pages_and_the_switch_leaves_weights_loaded(model_dirs, monkeypatch):
    if huge_pages.system_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {huge_pages.system_mode()} on this system")
    monkeypatch.setenv(huge_pages.ENV, "1")
    moved = load_model(model_dirs["llama"]).model.model.layers[0].mlp.down_proj.weight
    assert moved.data_ptr() % 64 == 0
    assert _mapping_flags(moved.data_ptr()).get("THPeligible") == "1"
    monkeypatch.setenv(huge_pages.ENV, "0")
    loaded = load_model(model_dirs["llama"]).model.model.layers[0].mlp.down_proj.weight
    assert _mapping_flags(loaded.data_ptr()).get("THPeligible") == "0"  # still in the file's mapping


def test_gathered_tensors_are_equal_copies_in_the_block(monkeypatch):
    """What an int8 draft's whole pass streams (its own int8 layout), gathered into the block."""
    parts = [torch.randint(-128, 128, (n, 1024), dtype=torch.int8) for n in (3, 4200, 7)]  # a huge page and more
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert all(a is b for a, b in zip(huge_pages.gather(parts), parts, strict=True))
    monkeypatch.setenv(huge_pages.ENV, "1")
    copies = huge_pages.gather(parts)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(copies, parts, strict=True))
    assert all(c.data_ptr() % huge_pages.ALIGN == 0 for c in copies)
    if huge_pages.system_mode() in ("always", "madvise"):
        assert _mapping_flags(copies[0].data_ptr()).get("THPeligible") == "1"
