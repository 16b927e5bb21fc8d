"""The whole lean pass (starjar.model.lean_pass): HF's values within rounding and HF generate()'s greedy tokens,
each kernel forced, rows and threads independent of each other, chosen by measurement or forced."""

import json

import pytest
import torch

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import colocated_engine
from starjar.cpu import few_rows, kernels, skinny_linear
from starjar.model import fused_projections, lean_choices, lean_pass, lean_target, native_pass
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams

TOLERANCE = 1e-4  # the largest logit difference taken from HF's (rounding; seen: under 2e-5 on the tiny models)


def _spy(monkeypatch) -> list:
    calls = []
    run = lean_pass.run
    monkeypatch.setattr(lean_pass, "run", lambda *a, **k: calls.append(tuple(a[0].shape[:2])) or run(*a, **k))
    return calls


def _passes(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of the passes the engines make on consecutive slots: a prefill of three rows, one-token steps at
    batch 1, verification over 4 positions at batch 1 and 3, rows of unequal lengths, and a token-tree pass."""
    cache = model.new_cache()
    slots = [cache.allocate() for _ in range(3)]
    out = model.forward(cache, slots, [p[:24] for p in prompts[:3]], [[23]] * 3)  # 72 rows: long, not taken
    for tok in (3, 4, 5):
        out += model.forward(cache, slots[:1], [[tok]], [[0]])
    out += model.forward(cache, slots[:1], [[6, 7, 8, 9]], [[0, 1, 2, 3]])
    out += model.forward(cache, slots, [[10, 11, 12, 13]] * 3, [[0, 1, 2, 3]] * 3)
    out += model.forward(cache, slots, [[14, 15], [16], [17, 18]], [[0, 1], [0], [0, 1]])
    # Root 19 with children 20 and 21, 22 under 20: four tokens positioned by depth, each seeing its ancestors.
    out += model.forward(cache, slots[:1], [[19, 20, 21, 22]], [[0, 1, 2, 3]], trees=[(0, [-1, 0, 0, 1])])
    return out


def _hf_then_lean(model, prompts, monkeypatch) -> tuple[list, list]:
    monkeypatch.setenv(lean_target.ENV, "0")
    hf = _passes(model, prompts)
    monkeypatch.setenv(lean_target.ENV, "1")
    monkeypatch.setenv(lean_pass.ENV, "1")
    return hf, _passes(model, prompts)


def _first_row_verified(model, prompt_ids, length: int, rows: int, threads: int) -> torch.Tensor:
    """The first row's logits of a 3-token verification over `rows` rows, each after its prompt's first `length`
    tokens, on `threads` threads."""
    cache = model.new_cache()
    slots = [cache.allocate() for _ in range(rows)]
    model.forward(cache, slots, [p[:length] for p in prompt_ids[:rows]], [[length - 1]] * rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return model.forward(cache, slots, [[6, 7, 8]] * rows, [[0, 1, 2]] * rows)[0]
    finally:
        torch.set_num_threads(before)


def _close(hf: list, lean: list) -> None:
    for a, b in zip(hf, lean, strict=True):
        assert (a - b).abs().max() < TOLERANCE, (a - b).abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("isa", [*sorted(few_rows.ISAS), "avx512-streamed", "avx512-twinned"])
def test_every_pass_is_hf_within_rounding_on_each_kernel(model_dirs, prompt_ids, monkeypatch, family, isa):
    """Steps, verification, multi-row, unequal-length and tree passes (qwen2: biased q/k/v) with each kernel
    this CPU has forced (AVX-512's weight rows interleaved, streamed, then streamed two runs a thread at once):
    HF's logits within TOLERANCE, the same argmax; prefill keeps the other passes."""
    assert lean_pass.available()
    name, way = isa.partition("-")[::2]
    if few_rows.ISAS[name] > torch.ops.starjar.lean_pass_isa():
        pytest.skip(f"this CPU lacks {name}")
    monkeypatch.setenv(few_rows.ISA_ENV, name)
    mask = {"streamed": few_rows.ALL_STREAMED & ~few_rows.TWINNED, "twinned": few_rows.ALL_STREAMED}.get(way, 0)
    monkeypatch.setenv(few_rows.STREAM_ENV, str(mask))
    model = load_model(model_dirs[family])
    calls = _spy(monkeypatch)
    hf, lean = _hf_then_lean(model, prompt_ids[:3], monkeypatch)
    assert calls == [(1, 1)] * 3 + [(1, 4), (3, 4), (3, 2), (1, 4)]
    _close(hf, lean)


@pytest.fixture(scope="module")
def wide_head_dirs(model_dirs, tmp_path_factory):
    """Llama targets whose heads are 64 and 128 wide (the widths the vector attention takes), 9 query heads on
    3 KV heads: groups of 3 heads that share their keys, which 2 threads split 4 / 5."""
    from benchmarks.fixtures.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("wide_heads")
    return {d: make_tiny_model(root / str(d), "llama", seed=4, hidden=9 * d, heads=9, kv_heads=3,
                               tokenizer_from=model_dirs["llama"]) for d in (64, 128)}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("isa", sorted(few_rows.ISAS))
def test_heads_sharing_their_keys_give_each_head_alone_s_values(wide_head_dirs, prompt_ids, monkeypatch, d, isa):
    """Heads of 64 and 128 in groups of 3 on each kernel: HF's logits within rounding, and a row's logits the
    same bits alone on 2 threads, beside two other rows, and on 1 thread (the threads split the heads
    differently, so a sweep takes a different run of a group's heads each time; the output layer on the own
    product, whose sums do not depend on the rows either)."""
    assert lean_pass.available()
    if few_rows.ISAS[isa] > torch.ops.starjar.lean_pass_isa():
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv(few_rows.ISA_ENV, isa)
    monkeypatch.setenv(skinny_linear.ENV, "rows")
    model = load_model(wide_head_dirs[d])
    hf, lean = _hf_then_lean(model, prompt_ids[:3], monkeypatch)
    _close(hf, lean)

    alone = _first_row_verified(model, prompt_ids, 20, rows=1, threads=2)
    assert torch.equal(alone, _first_row_verified(model, prompt_ids, 20, rows=3, threads=2))
    assert torch.equal(alone, _first_row_verified(model, prompt_ids, 20, rows=1, threads=1))


def test_an_mlp_width_off_the_tiles_takes_the_two_phase_gate(model_dirs, prompt_ids, monkeypatch, tmp_path):
    """An MLP 70 wide (not whole tiles of 4): the gate-up product and SiLU meet at a barrier instead of one thread
    gating its own tiles, and every pass is still HF's within rounding."""
    from benchmarks.fixtures.tiny_models import make_tiny_model
    model = load_model(make_tiny_model(tmp_path / "odd", "llama", seed=4, intermediate=70,
                                       tokenizer_from=model_dirs["llama"]))
    calls = _spy(monkeypatch)
    hf, lean = _hf_then_lean(model, prompt_ids[:3], monkeypatch)
    assert calls == [(1, 1)] * 3 + [(1, 4), (3, 4), (3, 2), (1, 4)]
    _close(hf, lean)


def test_the_cache_holds_hf_keys_and_values_within_rounding(models, prompt_ids, monkeypatch):
    model = models["llama"]
    buffers = {}
    for way in ("0", "1"):
        monkeypatch.setenv(lean_target.ENV, way)
        monkeypatch.setenv(lean_pass.ENV, way)
        cache = model.new_cache()
        slot = cache.allocate()
        model.forward(cache, [slot], [prompt_ids[4]], [[len(prompt_ids[4]) - 1]])
        for tok in (5, 6, 7, 8):
            model.forward(cache, [slot], [[tok]], [[0]])
        model.forward(cache, [slot], [[9, 10, 11]], [[0, 1, 2]])
        buffers[way] = [t[slot, :, : cache.lengths[slot]].clone() for t in (*cache._keys, *cache._values)]
    for a, b in zip(buffers["0"], buffers["1"], strict=True):
        assert (a - b).abs().max() < TOLERANCE


def test_a_rows_values_do_not_depend_on_the_batch_or_the_threads(model_dirs, prompt_ids, monkeypatch):
    """One row's logits alone, beside two others, and on one thread: the same bits (the output layer on the
    own product too, whose sums do not depend on the rows either)."""
    monkeypatch.setenv(skinny_linear.ENV, "rows")
    model = load_model(model_dirs["llama"])
    monkeypatch.setenv(lean_target.ENV, "1")
    monkeypatch.setenv(lean_pass.ENV, "1")

    alone = _first_row_verified(model, prompt_ids, 12, rows=1, threads=2)
    assert torch.equal(alone, _first_row_verified(model, prompt_ids, 12, rows=3, threads=2))
    assert torch.equal(alone, _first_row_verified(model, prompt_ids, 12, rows=1, threads=1))


def test_weight_rows_interleaved_streamed_or_twinned_give_the_same_bits(model_dirs, prompt_ids, monkeypatch):
    """AVX-512's float products with their weight rows interleaved, streamed one run a thread, and two runs a
    thread at once (the gate and up halves side by side too), twinned on one thread: every pass's logits the same
    bits."""
    assert lean_pass.available()
    if torch.ops.starjar.lean_pass_isa() < few_rows.ISAS["avx512"]:
        pytest.skip("this CPU lacks AVX-512")
    monkeypatch.setenv(few_rows.ISA_ENV, "avx512")
    monkeypatch.setenv(skinny_linear.ENV, "rows")
    monkeypatch.setenv(lean_target.ENV, "1")
    monkeypatch.setenv(lean_pass.ENV, "1")
    model = load_model(model_dirs["llama"])
    ways, before = [], few_rows.stream_mask()
    try:
        for mask in (0, few_rows.ALL_STREAMED & ~few_rows.TWINNED, few_rows.ALL_STREAMED):
            few_rows.set_stream(mask)
            ways.append(_passes(model, prompt_ids))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread still walks both halves of its share
        try:
            ways.append(_passes(model, prompt_ids))
        finally:
            torch.set_num_threads(threads)
    finally:
        few_rows.set_stream(before)
    for interleaved, *others in zip(*ways, strict=True):
        assert all(torch.equal(interleaved, other) for other in others)


@pytest.mark.parametrize("gamma,batch", [(0, 1), (3, 1), (2, 4)])
def test_greedy_output_is_hf_generate_s(model_dirs, models, prompt_ids, monkeypatch, gamma, batch):
    monkeypatch.setenv(lean_pass.ENV, "1")
    target = load_model(model_dirs["llama"])
    calls = _spy(monkeypatch)
    prompts = prompt_ids[:8]
    alone = [hf_greedy(target, p, 32) for p in prompts]
    engine = colocated_engine(target, models["draft"] if gamma else None, gamma, batch)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=32))
    assert [r.output_ids for r in reqs] == alone
    assert len(calls) > 32


def test_it_runs_where_the_fused_products_would_differ(model_dirs, models, prompt_ids, monkeypatch):
    """Where products over the concatenated projections differ in the last bits (MKL on an AMD EPYC, AVX2),
    only the whole lean pass reads the concatenations: it runs, and greedy output is HF generate()'s."""
    monkeypatch.setattr(fused_projections, "_same_products", lambda *a: False)
    monkeypatch.setenv(lean_pass.ENV, "1")
    target = load_model(model_dirs["llama"])
    assert not target.lean_target.exact
    calls = _spy(monkeypatch)
    prompts = prompt_ids[:4]
    alone = [hf_greedy(target, p, 24) for p in prompts]
    engine = colocated_engine(target, models["draft"], 3, 1)
    assert [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=24))] == alone
    assert len(calls) > 8


def test_off_it_never_runs_and_forced_on_it_runs_every_chain_pass(models, prompt_ids, monkeypatch):
    model = models["llama"]
    calls = _spy(monkeypatch)
    monkeypatch.setenv(lean_target.ENV, "1")
    monkeypatch.setenv(lean_pass.ENV, "0")
    _passes(model, prompt_ids[:3])
    assert calls == []
    monkeypatch.setenv(native_pass.ENV, "0")  # forced on, it runs whatever the native pass's choice
    monkeypatch.setenv(lean_pass.ENV, "1")
    _passes(model, prompt_ids[:3])
    assert len(calls) == 7


def test_the_choice_is_measured_once_at_load_and_cached(model_dirs, monkeypatch, tmp_path):
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.delenv(lean_pass.ENV, raising=False)
    monkeypatch.delenv(lean_target.ENV, raising=False)
    monkeypatch.setattr(kernels, "_entries", {})
    model = load_model(model_dirs["llama"])
    assert set(model.lean_target.whole) == {"step", "rows", "wide"}  # settled at load
    stored = json.loads((tmp_path / "kernels.json").read_text())
    entries = [e for name, e in stored.items() if f"|{lean_choices.WHOLE_KIND}-" in name]
    assert len(entries) == 1 and entries[0]["whole"] == model.lean_target.whole
    assert set(entries[0]["ms"]["step"]) == {"whole", "other"}
    again = load_model(model_dirs["llama"])
    assert again.lean_target.whole == model.lean_target.whole
    assert json.loads((tmp_path / "kernels.json").read_text()) == stored  # read, not measured again


def test_bad_inputs_are_refused_with_the_reason(models):
    """The op checks what it is handed: a write position outside the buffers, a missing layer's weights."""
    assert lean_pass.available()
    lt = models["llama"].lean_target
    _, _, nqs, nks = lt.fused
    d, layers = lt.head_dim, len(lt.plan)
    x = torch.zeros(1, 1, lt.base.embed_tokens.weight.shape[1])
    cos = sin = torch.zeros(1, 1, 1, d)
    keys = [torch.zeros(1, nks[0], 8, d) for _ in range(layers)]
    values = [torch.zeros(1, nks[0], 8, d) for _ in range(layers)]
    args = (x, cos, sin, None, *lt.flat, keys, values, 0, 1, nqs, nks, d, lt.eps, lt.scaling)
    with pytest.raises(RuntimeError, match="write position lies outside"):
        lean_pass.run(*args, torch.tensor([[9]]))
    with pytest.raises(RuntimeError, match="written span lies outside"):
        lean_pass.run(*args[:8], 8, *args[9:])
    with pytest.raises(RuntimeError, match="six weights .two norms with int8 products. and four biases a layer"):
        lean_pass.run(x, cos, sin, None, lt.flat[0][:-1], *args[5:])
    assert lean_pass.run(*args).shape == x.shape
    with pytest.raises(RuntimeError, match="final norm weight"):
        lean_pass.run(*args, norm=torch.ones(3))


def test_the_final_norm_in_the_pass_is_the_model_s_within_rounding(models):
    """The model's final RMSNorm applied inside the pass gives what base.norm gives after it."""
    assert lean_pass.available()
    lt = models["llama"].lean_target
    _, _, nqs, nks = lt.fused
    d, layers, hidden = lt.head_dim, len(lt.plan), lt.base.embed_tokens.weight.shape[1]
    torch.manual_seed(0)
    x = torch.randn(2, 3, hidden)
    cos, sin = torch.ones(2, 3, d), torch.zeros(2, 3, d)
    keys = [torch.zeros(2, nks[0], 8, d) for _ in range(layers)]
    values = [torch.zeros(2, nks[0], 8, d) for _ in range(layers)]
    args = (x, cos, sin, None, *lt.flat, keys, values, 0, 3, nqs, nks, d, lt.eps, lt.scaling)
    assert lt._final_norm() is lt.base.norm.weight
    plain, normed = lean_pass.run(*args), lean_pass.run(*args, norm=lt._final_norm())
    with torch.no_grad():
        assert (normed - lt.base.norm(plain)).abs().max() < 1e-5
    assert not torch.allclose(normed, plain)


def test_wide_passes_follow_their_own_measured_class(models, monkeypatch):
    """Passes past WIDE_FROM rows (short prompts' prefill) take the whole pass by the wide probe's measurement."""
    monkeypatch.delenv(lean_pass.ENV, raising=False)
    lt = models["llama"].lean_target
    assert lean_pass.available()
    param = next(lt.model.parameters())
    lt.takes_whole(param, 1)  # settled as measured
    monkeypatch.setattr(lt, "whole", {"step": True, "rows": True, "wide": False})
    assert lt.takes_whole(param, 1) and lt.takes_whole(param, lean_choices.WIDE_FROM)
    assert not lt.takes_whole(param, lean_choices.WIDE_FROM + 1)
    monkeypatch.setattr(lt, "whole", {"step": False, "rows": False, "wide": True})
    assert lt.takes_whole(param, lean_choices.WIDE_FROM + 1) and not lt.takes_whole(param, 2)
