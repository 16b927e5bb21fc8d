"""The lean draft forward: the same function as Hugging Face's for a Llama-family int8 draft, and drafts from it
keep greedy output equal to the target's."""

import dataclasses

import pytest
import torch
from int8_drafts import int8_draft_dir, with_random_biases

from controller.colocated import colocated_engine
from starjar.model import native_draft
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lean_logits_match_the_hf_path_of_the_same_int8_model(tmp_path, model_dirs, family, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")  # the same function (float16: model.kv_precision)
    monkeypatch.setenv(native_draft.OWN_ENV, "torch")  # the HF path's int8 kernel (the own one is timed per machine)
    draft = load_model(int8_draft_dir(tmp_path, model_dirs[family]))
    assert draft.lean is not None
    hf = dataclasses.replace(draft, lean=None)
    prompts = [[5, 6, 7, 8, 9, 10], [100, 101, 102], [42] * 11]
    outs = []
    for m in (draft, hf):
        cache = m.new_cache()
        slots = [cache.allocate() for _ in prompts]
        first = m.forward(cache, slots, prompts, [list(range(len(p))) for p in prompts])
        step = m.forward(cache, slots, [[3, 4]] * 3, [[0, 1]] * 3)  # a ragged multi-token pass after them
        outs.append(torch.cat(first + step))
    # q/k/v and gate/up fused into one int8 linear each: the same int8 weights, scales and row scales.
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_gpt2_keeps_the_hf_path(tmp_path, model_dirs):
    assert load_model(int8_draft_dir(tmp_path, model_dirs["gpt2"])).lean is None


@pytest.mark.parametrize("head_vocab", [None, 200])
def test_greedy_output_with_a_lean_draft_is_the_targets(tmp_path, models, model_dirs, prompt_ids, reference,
                                                        head_vocab):
    recipe = {"head_vocab": head_vocab} if head_vocab else {}
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"], **recipe))
    if head_vocab:
        assert draft.lean.head.out_features == head_vocab  # ids past it are never proposed
    eng = colocated_engine(models["llama"], draft, 3, 8)
    outs = [r.output_ids for r in eng.generate(prompt_ids[:8], SamplingParams(max_tokens=48))]
    assert outs == reference("llama", 48)[:8]
    # A 200-id head cannot propose the target's tokens past it: fewer drafts are right, all still exact.
    assert eng.stats.acceptance_rate > (0.2 if head_vocab else 0.5)


def test_a_draft_without_some_layers_runs_only_the_others_and_stays_lossless(tmp_path, models, model_dirs,
                                                                              prompt_ids, reference):
    full = load_model(int8_draft_dir(tmp_path / "full", model_dirs["llama"]))
    draft = load_model(int8_draft_dir(tmp_path / "skip", model_dirs["llama"], skip_layers=[1]))
    assert draft.lean.skipped == (1,) and len(draft.lean.plan) == len(full.lean.plan) - 1
    def last_logits(m):
        cache = m.new_cache()
        return m.forward(cache, [cache.allocate()], [prompt_ids[0]], [[len(prompt_ids[0]) - 1]])[0]
    skipped = last_logits(draft)
    assert not torch.allclose(last_logits(full), skipped)  # the layer really is left out
    full.lean.leave_out((1,))  # what `models build` does to score a skip set on one loaded draft
    assert torch.equal(last_logits(full), skipped)
    full.lean.leave_out(())
    assert not torch.equal(last_logits(full), skipped)
    eng = colocated_engine(models["llama"], draft, 3, 8)
    outs = [r.output_ids for r in eng.generate(prompt_ids[:8], SamplingParams(max_tokens=48))]
    assert outs == reference("llama", 48)[:8]


@pytest.mark.parametrize("skip", [[0, 1], [5], [1, 1], "1", [True]])
def test_a_bad_skip_set_is_invalid_argument(tmp_path, model_dirs, skip):
    from starjar.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="skip_layers"):
        load_model(int8_draft_dir(tmp_path, model_dirs["llama"], skip_layers=skip))


def counted(monkeypatch, name: str) -> list:
    """starjar.model.lean_step's `name` (a scripted layer's getter) wrapped to record each pass that asks for it."""
    from starjar.model import lean_step
    calls = []
    real = getattr(lean_step, name)
    monkeypatch.setattr(lean_step, name, lambda: calls.append(1) or real())
    return calls


@pytest.mark.parametrize("family,cache_kw", [("llama", {}), ("qwen2", {}),
                                             ("llama", {"initial_capacity": 8}), ("llama", {"max_cells": 64}),
                                             ("llama", {"dtype": torch.float16, "max_cells": 64})])
def test_scripted_one_token_steps_are_the_eager_steps_bit_for_bit(tmp_path, model_dirs, family, cache_kw,
                                                                 monkeypatch):
    """starjar.model.lean_step runs a one-row, one-token pass as one scripted function per layer: the logits and the
    K/V it writes must be exactly the eager lean forward's, step after step, on the second slot of a cache that
    grows (or is budgeted) between steps."""
    from starjar.model.kv_cache import RaggedKVCache

    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")  # a catch-up's kernel, whatever this machine chose
    monkeypatch.setenv("STARJAR_NATIVE_PASS", "0")  # the scripted step, not the native one (test_native_draft)
    draft = load_model(int8_draft_dir(tmp_path, model_dirs[family]))
    assert draft.lean.scriptable
    calls = counted(monkeypatch, "layer_fn")

    def run(env: str):
        monkeypatch.setenv("STARJAR_LEAN_SCRIPT", env)
        cache = RaggedKVCache(draft.device, **{"dtype": draft.dtype, **cache_kw})  # dtype: the KV precision
        other, slot = cache.allocate(), cache.allocate()
        draft.forward(cache, [other], [[9, 8, 7]], [[2]])
        outs = [draft.forward(cache, [slot], [[5, 6, 7, 8, 9]], [[4]])[0]]
        for t in (11, 12, 13, 14, 15, 16):
            outs.append(draft.forward(cache, [slot], [[t]], [[0]])[0])
        outs.append(draft.forward(cache, [slot], [[15, 16]], [[1]])[0])  # a catch-up: the multi-row layer
        outs.append(draft.forward(cache, [slot], [[17]], [[0]])[0])
        n = cache.lengths[slot]
        kv = [t[slot, :, :n] for t in cache._keys + cache._values]
        return torch.cat(outs), kv

    eager, eager_kv = run("0")
    assert not calls
    scripted, scripted_kv = run("1")
    assert len(calls) == 7  # every one-token step took the scripted path
    assert torch.equal(eager, scripted)
    assert all(torch.equal(a, b) for a, b in zip(eager_kv, scripted_kv, strict=True))


def test_a_tree_pass_never_takes_the_scripted_layers():
    """A tree pass keeps the eager forward (its rows are beams positioned by depth, not a chain)."""
    from starjar.model.kv_cache import RaggedKVCache

    cache = RaggedKVCache()
    slot = cache.allocate()
    cache.begin([slot], [1])
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    cache.begin([slot], [1])
    assert cache.pass_views(1) is not None
    cache.begin([slot], [1], [(cache.lengths[slot], [-1])])
    assert cache.pass_views(1) is None


@pytest.mark.parametrize("family,cache_kw,kernel", [
    ("llama", {}, "fused"), ("qwen2", {"initial_capacity": 8}, "fused"), ("llama", {"max_cells": 96}, "fused"),
    ("qwen2", {"dtype": torch.float16}, "fused"), ("llama", {"dtype": torch.float16, "max_cells": 96}, "fused"),
    ("llama", {}, "int_mm"), ("qwen2", {"initial_capacity": 8}, "int_mm"),
    ("llama", {"dtype": torch.float16, "max_cells": 96}, "int_mm")])
def test_scripted_multi_row_passes_are_the_eager_passes_bit_for_bit(tmp_path, model_dirs, family, cache_kw, kernel,
                                                                   monkeypatch):
    """Several rows or several tokens (batched drafting, catch-ups, prefill into a grown cache) run as
    starjar.model.lean_step's scripted multi-row layer, on either int8 kernel: ragged rows (scattered writes, a padded
    row), rows that write one span, a two-token catch-up, rows of non-consecutive slots (written through the whole
    buffers, then gathered). Logits and every layer's K/V must be exactly the eager forward's."""
    from starjar.model.kv_cache import RaggedKVCache

    monkeypatch.setenv("STARJAR_INT8_KERNEL", kernel)  # the multi-row layer's kernel, whatever this machine chose
    monkeypatch.setenv("STARJAR_NATIVE_PASS", "0")  # the scripted catch-up, not the native one (test_native_draft)
    target = with_random_biases(tmp_path, model_dirs[family]) if family == "qwen2" else model_dirs[family]
    draft = load_model(int8_draft_dir(tmp_path, target))
    mats = [m for layer in draft.lean._mats for m in layer]  # the int_mm weights the scripted layer is given
    assert mats and all((m is not None) == (kernel == "int_mm") for m in mats)
    calls = counted(monkeypatch, "rows_layer_fn")
    from starjar.model import lean_decoder
    ragged, real_tokens = [], lean_decoder._real_tokens  # passes whose linears ran on their real tokens only
    monkeypatch.setattr(lean_decoder, "_real_tokens", lambda c, q: ragged.append(real_tokens(c, q)) or ragged[-1])

    def run(env: str):
        monkeypatch.setenv("STARJAR_LEAN_SCRIPT", env)
        cache = RaggedKVCache(draft.device, **{"dtype": draft.dtype, **cache_kw})  # dtype: the KV precision
        a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
        outs = [torch.cat(draft.forward(cache, [a, b, c], [[5, 6, 7, 8], [9, 10], [11, 12, 13]],
                                        [[3], [1], [2]]))]  # the first pass: buffers allocated, eager
        for t in range(3):  # ragged one-token rows: scattered writes
            outs += draft.forward(cache, [a, b, c], [[20 + t], [30 + t], [40 + t]], [[0]] * 3)
        outs += draft.forward(cache, [a, b, c], [[50, 51], [52], [53, 54]], [[0, 1], [0], [0, 1]])  # a padded row
        outs += draft.forward(cache, [b], [[60, 61]], [[0, 1]])  # a one-row catch-up
        cache.truncate(a, cache.lengths[b])
        cache.truncate(c, cache.lengths[b])
        outs += draft.forward(cache, [a, b, c], [[70], [71], [72]], [[0]] * 3)  # one span for every row
        outs += draft.forward(cache, [a, c], [[80], [81]], [[0]] * 2)  # slots 0 and 2: not consecutive
        outs += draft.forward(cache, [a, c], [[82, 83], [84]], [[0, 1], [0]])  # ragged, not consecutive
        kv = [t[s, :, :cache.lengths[s]] for s in (a, b, c) for t in cache._keys + cache._values]
        return torch.cat(outs), kv

    eager, eager_kv = run("0")
    assert not calls
    scripted, scripted_kv = run("1")
    assert len(calls) == 8  # every pass but the first
    # The first pass and the two padded ones, in each run: 4 + 2 + 3 real tokens of 12, 2 + 1 + 2 of 6, 2 + 1 of 4.
    assert [r.tolist() for r in ragged if r is not None] == [[0, 1, 2, 3, 4, 5, 8, 9, 10], [0, 1, 2, 4, 5],
                                                             [0, 1, 2]] * 2
    assert torch.equal(eager, scripted)
    assert all(torch.equal(x, y) for x, y in zip(eager_kv, scripted_kv, strict=True))


def test_int_mm_on_its_generic_kernel_keeps_the_eager_multi_row_passes(tmp_path, model_dirs, monkeypatch):
    """The generic _int_mm kernel (STARJAR_INT_MM_ONEDNN=0, the AVX2 cliff emulated) is chosen per call with oneDNN
    switched off around it, which a scripted layer cannot do: its multi-row passes stay eager, its one-token steps
    scripted, and the output is the same as with oneDNN's kernel."""
    from starjar.model.kv_cache import RaggedKVCache

    monkeypatch.setenv("STARJAR_INT8_KERNEL", "int_mm")
    monkeypatch.setenv("STARJAR_NATIVE_PASS", "0")  # one-token steps scripted, as counted below
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"]))
    rows_calls, step_calls = counted(monkeypatch, "rows_layer_fn"), counted(monkeypatch, "layer_fn")

    def run() -> torch.Tensor:
        cache = RaggedKVCache(draft.device, dtype=draft.dtype)
        a, b = cache.allocate(), cache.allocate()
        outs = list(draft.forward(cache, [a, b], [[5, 6, 7], [9, 10]], [[2], [1]]))
        outs += draft.forward(cache, [a, b], [[20], [30]], [[0]] * 2)  # two rows: the multi-row layer
        outs += draft.forward(cache, [a], [[21]], [[0]])  # one row, one token: the one-token step
        return torch.cat(outs)

    monkeypatch.setenv("STARJAR_INT_MM_ONEDNN", "0")
    generic = run()
    assert not rows_calls and len(step_calls) == 1
    monkeypatch.setenv("STARJAR_INT_MM_ONEDNN", "1")
    onednn = run()
    assert len(rows_calls) == 1 and len(step_calls) == 2
    assert torch.allclose(generic, onednn, atol=1e-4)  # int32 sums: both kernels exact, bar the float rescale
