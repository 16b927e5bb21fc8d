"""The lean target forward (starjar.model.lean_target): Hugging Face's logits to the last bit, on every pass shape."""

import pytest
import torch
from exact_fusion import needs_exact_fusion

from controller.colocated import colocated_engine
from starjar.cpu import huge_pages, kernels, skinny_linear
from starjar.model import fused_projections, lean_choices, lean_target
from starjar.model.lean_target import ENV, LeanTarget
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


def _spy(model, monkeypatch) -> list:
    """Counts calls of the model's HF decoder forward (the eager path)."""
    calls = []
    base = model.model.base_model
    forward = base.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(base, "forward", counted)
    return calls


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _passes(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of a run of every pass shape the engines make, in a fresh cache: a ragged multi-row prefill, a lone
    prefill, one-token steps at batch 1, verification over 4 positions, one-token steps of several rows,
    ragged multi-token rows, rows on scattered slots, and a long pass."""
    cache = model.new_cache()
    slots = [cache.allocate() for _ in range(5)]
    out = model.forward(cache, slots[:4], prompts[:4], [list(range(len(p))) for p in prompts[:4]])
    out += model.forward(cache, slots[4:], prompts[4:5], [[len(prompts[4]) - 1]])
    for tok in (5, 9, 14):
        out += model.forward(cache, slots[:1], [[tok]], [[0]])
    out += model.forward(cache, slots[1:2], [[3, 4, 5, 6]], [[0, 1, 2, 3]])
    out += model.forward(cache, slots[2:3], [[3, 4]], [[0, 1]])  # 2 rows: where F.linear and W @ x.T differ
    out += model.forward(cache, slots, [[7]] * 5, [[0]] * 5)
    out += model.forward(cache, slots, [[8, 9, 10], [11], [12, 13], [14, 15, 16], [17]],
                         [[0, 1, 2], [0], [0, 1], [0, 1, 2], [0]])
    out += model.forward(cache, [slots[0], slots[2], slots[4]], [[20], [21], [22]], [[0], [0], [0]])
    out += model.forward(cache, [slots[1], slots[3]], [[23, 24], [25, 26]], [[0, 1], [0, 1]])
    out += model.forward(cache, slots[2:3], [list(range(30, 100))], [list(range(70))])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("path,scattered_by_hf", [("linear", 0), ("rows", 2)])
def test_lean_logits_equal_hf_bitwise(model_dirs, prompt_ids, monkeypatch, family, path, scattered_by_hf):
    """Under each product skinny_linear may install: the lean forward runs every pass, except the two on
    scattered slots where starjar's own product is installed (the native pass takes consecutive slots only):
    those run HF's forward, the same product."""
    monkeypatch.setenv(skinny_linear.ENV, path)
    model = load_model(model_dirs[family])
    needs_exact_fusion(model)
    assert model.lean_target.fused is not None  # steps take the fused layers
    calls = _spy(model, monkeypatch)
    monkeypatch.setenv(ENV, "0")
    hf = _passes(model, prompt_ids[:5])
    assert len(calls) == 12  # every pass ran HF's forward
    monkeypatch.setenv(ENV, "1")
    lean = _passes(model, prompt_ids[:5])
    assert len(calls) == 12 + scattered_by_hf  # ... and here only those the lean forward leaves to it
    assert len(hf) == len(lean)
    for a, b in zip(hf, lean, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_projections_change_no_bit(model_dirs, prompt_ids, monkeypatch, family):
    """The fused model's lean passes equal HF's forward on a model loaded with its weights left apart, and the
    projections are views of the concatenations (no second copy)."""
    monkeypatch.setattr(fused_projections, "_same_products", lambda *a: False)  # as on a machine where they differ
    apart = load_model(model_dirs[family])
    assert not apart.lean_target.exact and not apart.lean_target.takes_fused(1)
    assert apart.lean_target.fused is None  # no copies kept: the whole lean pass is off (tests/conftest.py)
    attn = apart.model.model.layers[0].self_attn
    assert "weight" in attn.q_proj._parameters  # left as loaded: a Parameter, back to back with k and v's
    assert huge_pages.adjacent([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
    monkeypatch.setenv(ENV, "0")
    hf = _passes(apart, prompt_ids[:5])
    monkeypatch.setenv(ENV, "1")
    assert [torch.equal(a, b) for a, b in zip(hf, _passes(apart, prompt_ids[:5]), strict=True)] == [True] * len(hf)
    monkeypatch.undo()
    monkeypatch.setenv(ENV, "1")
    fused = load_model(model_dirs[family])
    needs_exact_fusion(fused)
    layer = fused.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    _, qkv, _, _, gate_up, _ = fused.lean_target.fused[0][0]  # views of the loaded weights: no copy
    assert qkv.data_ptr() == attn.q_proj.weight.data_ptr() and gate_up.data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert _storage(attn.q_proj.weight) == _storage(attn.k_proj.weight) == _storage(attn.v_proj.weight)
    assert _storage(mlp.gate_proj.weight) == _storage(mlp.up_proj.weight)
    assert [torch.equal(a, b) for a, b in zip(hf, _passes(fused, prompt_ids[:5]), strict=True)] == [True] * len(hf)


@pytest.mark.parametrize("fused", [True, False])
def test_rows_passes_fused_or_apart_equal_hf(model_dirs, prompt_ids, monkeypatch, tmp_path, fused):
    """Each way a multi-row pass may run (its bucket's measured choice, forced here), HF's bits."""
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_entries", {})
    model = load_model(model_dirs["qwen2"])  # biased q/k/v: the fused bias too
    needs_exact_fusion(model)
    lean = model.lean_target
    assert len(lean.fused_rows) == len(skinny_linear.BUCKETS)  # measured at load
    assert (tmp_path / "kernels.json").read_text().count(lean_choices.FUSED_KIND) == 1
    lean.fused_rows = [fused] * len(skinny_linear.BUCKETS)
    layers = {"fused": 0, "apart": 0}
    for name, attr in (("fused", "fused_rows_layer"), ("apart", "rows_layer")):
        layer = getattr(lean, attr)
        monkeypatch.setattr(lean, attr, lambda *a, _n=name, _f=layer: layers.__setitem__(_n, layers[_n] + 1) or _f(*a))
    monkeypatch.setenv(ENV, "0")
    hf = _passes(model, prompt_ids[:5])
    monkeypatch.setenv(ENV, "1")
    assert [torch.equal(a, b) for a, b in zip(hf, _passes(model, prompt_ids[:5]), strict=True)] == [True] * len(hf)
    assert (layers["fused"] > 0, layers["apart"] > 0) == (fused, not fused)


@pytest.mark.parametrize("path", ["linear", "wxt", "packed"])
def test_lean_takes_each_few_rows_product(model_dirs, prompt_ids, monkeypatch, path):
    """Each product starjar.cpu.skinny_linear may install for a row count, taken as HF's linears take it."""
    monkeypatch.setenv(skinny_linear.ENV, path)
    monkeypatch.setenv(ENV, "0")
    model = load_model(model_dirs["llama"])
    needs_exact_fusion(model)
    attn = model.model.model.layers[0].self_attn
    # Packed at load: the whole qkv where a bucket runs it fused, the three apart where one runs them apart.
    lean = model.lean_target
    assert (lean._fused_packs[0][0] is not None) == (path == "packed" and any(lean.fused_rows))
    assert ("_starjar_packed" in attn.q_proj.__dict__) == (path == "packed" and not all(lean.fused_rows))
    hf = _passes(model, prompt_ids[:5])
    monkeypatch.setenv(ENV, "1")
    for a, b in zip(hf, _passes(model, prompt_ids[:5]), strict=True):
        assert torch.equal(a, b)


def test_lean_bfloat16_equals_hf_bitwise(model_dirs, prompt_ids, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    model = load_model(model_dirs["llama"], dtype="bfloat16")
    assert model.lean_target is not None
    hf = _passes(model, prompt_ids[:5])
    monkeypatch.setenv(ENV, "1")
    for a, b in zip(hf, _passes(model, prompt_ids[:5]), strict=True):
        assert torch.equal(a, b)


def _tree_passes(model) -> list[torch.Tensor]:
    """A prompt, then token-tree verification passes (trees of RaggedKVCache.begin) on one and two rows."""
    cache = model.new_cache()
    slots = [cache.allocate() for _ in range(2)]
    out = model.forward(cache, slots, [[5, 6, 7, 8], [9, 10, 11]], [[3], [2]])
    # Root 12 with children 13 and 14, 15 under 13: four tokens positioned by depth, each seeing its ancestors.
    out += model.forward(cache, slots[:1], [[12, 13, 14, 15]], [[0, 1, 2, 3]], trees=[(0, [-1, 0, 0, 1])])
    cache.truncate(slots[0], 5)
    out += model.forward(cache, slots, [[13, 16, 17], [18, 19]], [[0, 1, 2], [0, 1]],
                         trees=[(0, [-1, 0, 0]), None])
    return out


def test_tree_passes_equal_hf_bitwise(models, monkeypatch):
    model = models["llama"]
    calls = _spy(model, monkeypatch)
    monkeypatch.setenv(ENV, "0")
    hf = _tree_passes(model)
    assert len(calls) == 3
    monkeypatch.setenv(ENV, "1")
    lean = _tree_passes(model)
    assert len(calls) == 3
    for a, b in zip(hf, lean, strict=True):
        assert torch.equal(a, b)


def test_other_families_keep_hf_forward(models):
    assert models["gpt2"].lean_target is None
    assert not LeanTarget.supports(models["gpt2"].model)


def test_env_values(monkeypatch):
    for value, want in (("1", True), ("0", False), ("", None), ("auto", None)):
        monkeypatch.setenv(ENV, value)
        assert lean_target.forced() is want
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError):
        lean_target.forced()


def test_measured_choice_is_cached(model_dirs, monkeypatch, tmp_path):
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_entries", {})  # nothing this process measured before
    monkeypatch.delenv(ENV, raising=False)
    model = load_model(model_dirs["qwen2"])  # measures each pass class at load
    assert set(model.lean_target.choice) == set(lean_choices.CLASSES)
    assert (tmp_path / "kernels.json").read_text().count(lean_choices.KIND) == 1
    monkeypatch.setattr(kernels, "_entries", {})
    again = LeanTarget(model.model)
    monkeypatch.setattr(kernels, "interleaved_medians", lambda *a, **k: pytest.fail("measured again"))
    again.settle()  # read from the cache
    assert again.choice == model.lean_target.choice
    assert again.wants(1, 1) == again.choice["step"] and again.wants(4, 4) == again.choice["rows"]
    monkeypatch.setenv(ENV, "0")
    assert not again.wants(1, 1)


@pytest.mark.parametrize("lean", ["1", "0"])
@pytest.mark.parametrize("batch_size,gamma", [(1, 0), (4, 0), (1, 3), (8, 2)])
def test_engine_greedy_equals_reference(models, prompt_ids, reference, monkeypatch, lean, batch_size, gamma):
    monkeypatch.setenv(ENV, lean)
    engine = colocated_engine(models["llama"], models["draft"] if gamma else None, gamma, batch_size)
    reqs = engine.generate(prompt_ids[:16], SamplingParams(max_tokens=64))
    assert [r.output_ids for r in reqs] == reference("llama")[:16]
