"""The int8 draft's native one-row passes (starjar.model.native_draft): the scripted layers' values, chosen by
measurement or forced, and lossless through the engine."""

import pytest
import torch
from int8_drafts import int8_draft_dir, with_random_biases

from controller.colocated import colocated_engine
from starjar.cpu import few_rows, kernels
from starjar.model import lean_pass, native_draft, native_pass
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams


def _steps(draft, prompts: list[list[int]], native: bool | None, steps: int = 10) -> torch.Tensor:
    """Logits of a prefill, one-token steps and catch-ups of 2 and 3 tokens per prompt, each in its own cache."""
    draft.lean.native.override = native
    try:
        out = []
        for prompt in prompts:
            cache = draft.new_cache()
            slot = cache.allocate()
            out += draft.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
            for tok in range(3, 3 + steps):
                out += draft.forward(cache, [slot], [[tok]], [[0]])
            out += draft.forward(cache, [slot], [[40, 41]], [[0, 1]])
            out += draft.forward(cache, [slot], [[42, 43, 44]], [[0, 1, 2]])
            out += draft.forward(cache, [slot], [[45]], [[0]])
        return torch.cat(out)
    finally:
        draft.lean.native.override = None


def _counted(monkeypatch) -> list:
    calls = []
    run = native_pass.run_draft
    monkeypatch.setattr(native_pass, "run_draft", lambda *a: calls.append(a[10]) or run(*a))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_drafting_natively_is_the_scripted_layers_bit_for_bit(tmp_path, model_dirs, monkeypatch, family):
    """Rows on consecutive slots, of unequal lengths (each token written where the cache says) or one span,
    padded passes (rows of unequal token counts: their real tokens alone in the products) and a one-row
    catch-up: logits and K/V the scripted layers'; scattered passes stay scripted."""
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")
    monkeypatch.setenv(native_draft.OWN_ENV, "torch")  # the scripted layers' kernel, for their bits
    target = with_random_biases(tmp_path, model_dirs[family]) if family == "qwen2" else model_dirs[family]
    draft = load_model(int8_draft_dir(tmp_path, target))
    shapes = []
    run_draft = native_pass.run_draft
    monkeypatch.setattr(native_pass, "run_draft", lambda *a: shapes.append(tuple(a[0].shape[:2])) or run_draft(*a))

    def run(native: bool):
        draft.lean.native.override = native
        cache = draft.new_cache()
        a, b, c = (cache.allocate() for _ in range(3))
        outs = list(draft.forward(cache, [a, b, c], [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [[3], [1], [2]]))
        for t in range(3):  # unequal lengths
            outs += draft.forward(cache, [a, b, c], [[20 + t], [30 + t], [40 + t]], [[0]] * 3)
        outs += draft.forward(cache, [a, b, c], [[50, 51], [52], [53, 54]], [[0, 1], [0], [0, 1]])  # padded
        cache.truncate(a, cache.lengths[b])
        cache.truncate(c, cache.lengths[b])
        outs += draft.forward(cache, [a, b, c], [[70], [71], [72]], [[0]] * 3)  # one span
        outs += draft.forward(cache, [a, c], [[80], [81]], [[0]] * 2)  # slots 0 and 2: not consecutive
        outs += draft.forward(cache, [b], [[90, 91]], [[0, 1]])  # a catch-up
        draft.lean.native.override = None
        kv = [t[s, :, :cache.lengths[s]] for s in (a, b, c) for t in cache._keys + cache._values]
        return torch.cat(outs), kv

    scripted, scripted_kv = run(False)
    assert shapes == []
    native, native_kv = run(True)
    assert shapes == [(3, 1)] * 3 + [(5, 1), (3, 1), (1, 2)]  # a padded pass: its real tokens
    assert torch.equal(native, scripted)
    assert all(torch.equal(x, y) for x, y in zip(native_kv, scripted_kv, strict=True))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_passes_are_the_scripted_layers_bit_for_bit(tmp_path, model_dirs, prompt_ids, monkeypatch, family):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")  # the row-scaled products that catch-ups run natively
    monkeypatch.setenv(native_draft.OWN_ENV, "torch")  # the scripted layers' kernel, for their bits
    target = with_random_biases(tmp_path, model_dirs[family]) if family == "qwen2" else model_dirs[family]
    draft = load_model(int8_draft_dir(tmp_path, target))
    assert native_pass.available(), native_pass.unavailable_reason()
    calls = _counted(monkeypatch)
    scripted = _steps(draft, prompt_ids[:3], False)
    assert calls == []
    native = _steps(draft, prompt_ids[:3], True)
    # Every pass after each prompt's prefill (into a fresh cache, which the eager layers make), from where it
    # belongs.
    n = len(prompt_ids[0])
    assert calls[:13] == [*range(n, n + 10), n + 10, n + 12, n + 15]
    assert len(calls) == 3 * 13
    assert torch.equal(native, scripted)


def test_a_float16_cache_keeps_the_scripted_step(tmp_path, model_dirs, prompt_ids, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float16")
    monkeypatch.setenv(native_pass.ENV, "1")
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"]))
    calls = _counted(monkeypatch)
    _steps(draft, prompt_ids[:1], None, steps=3)
    assert calls == []


@pytest.mark.parametrize("way", ["0", "1"])
def test_greedy_output_with_the_step_forced_each_way_is_the_targets(tmp_path, models, model_dirs, prompt_ids,
                                                                     reference, monkeypatch, way):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv(native_pass.ENV, way)
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"]))
    calls = _counted(monkeypatch)
    eng = colocated_engine(models["llama"], draft, 3, 1)
    outs = [r.output_ids for r in eng.generate(prompt_ids[:4], SamplingParams(max_tokens=32))]
    assert outs == reference("llama", 32)[:4]
    assert (len(calls) > 0) == (way == "1")


def test_with_the_int_mm_products_only_one_token_steps_run_natively(tmp_path, model_dirs, prompt_ids, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "int_mm")
    monkeypatch.setenv(native_pass.ENV, "1")
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"]))
    calls = _counted(monkeypatch)
    _steps(draft, prompt_ids[:1], None, steps=2)
    n = len(prompt_ids[0])
    assert calls == [n, n + 1, n + 7]  # the steps; the prefill and the catch-ups keep the scripted int_mm layers


def test_the_choice_is_measured_once_per_machine_and_cached(tmp_path, model_dirs, prompt_ids, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path / "home"))  # a kernel cache of its own
    monkeypatch.delenv(native_pass.ENV, raising=False)
    measured = []
    real = native_draft.NativeDraftPass._measure
    monkeypatch.setattr(native_draft.NativeDraftPass, "_measure",
                        lambda self, probe, reps=3: measured.append(1) or real(self, probe, reps))
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")
    for i in range(2):
        kernels._entries.clear()  # a new process reads the kept entry
        draft = load_model(int8_draft_dir(tmp_path / str(i), model_dirs["llama"]))
        assert draft.lean.native.chosen is not None  # measured at load, not in a served pass
    assert measured == [1]
    entry = next(e for name, e in kernels.cached_entries().items() if native_draft.KIND in name)
    assert set(entry["ms"]) == set(native_draft.PROBES) and entry["native"] == draft.lean.native.chosen
    assert all(set(ms) == {"scripted", "native"} for ms in entry["ms"].values())


@pytest.mark.parametrize("new_process", [False, True])
def test_a_choice_made_for_one_row_passes_only_is_measured_again_for_a_draft_whose_spans_run_natively(
        tmp_path, model_dirs, monkeypatch, new_process):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path / "home"))  # a kernel cache of its own
    monkeypatch.delenv(native_pass.ENV, raising=False)
    kernels._entries.clear()
    kinds = ("_measured", "_own_measured", "_whole_measured")
    measured = []
    for kind in kinds:
        real = getattr(native_draft.NativeDraftPass, kind)
        monkeypatch.setattr(native_draft.NativeDraftPass, kind,
                            lambda self, probe, real=real, kind=kind: measured.append((kind, self.spans)) or
                            real(self, probe))
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "int_mm")  # its several-row passes stay scripted: not timed
    load_model(int8_draft_dir(tmp_path / "one-row", model_dirs["llama"]))
    one_row = {n: e for n, e in kernels.cached_entries().items() if native_draft.KIND in n}
    assert one_row and all(set(e["ms"]) == {"step"} for e in one_row.values())
    if new_process:
        kernels._entries.clear()
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")
    spans = load_model(int8_draft_dir(tmp_path / "spans", model_dirs["llama"]))
    assert spans.lean.native.spans
    entry = kernels.cached_entries()[next(iter(one_row))]
    assert set(entry["ms"]) == set(native_draft.PROBES)  # timed again, every class this time
    assert entry["native"] == spans.lean.native.chosen
    assert ("_measured", True) in measured


def _tree_and_steps(draft, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of tree passes past a chain they must not see (a fanout branch's token off the prompt's last one, then
    its child; then two siblings off that root in one pass, as a beam's), and of the same passes where no chain
    was: the branch's tokens fed one at a time after the prompt, the siblings' tree pass right after it."""
    def prefilled():
        cache = draft.new_cache()
        slot = cache.allocate()
        draft.forward(cache, [slot], [prompt], [[len(prompt) - 1]])
        return cache, slot

    cache, slot = prefilled()
    draft.forward(cache, [slot], [[7, 8, 9]], [[2]])  # the chain, hidden from every tree token
    root = len(prompt) - 1  # the region's first token: the prompt's last; cached 4 (the root and the chain)
    tree = draft.forward(cache, [slot], [[5]], [[0]], trees=[(4, [-1, 0, 0, 0, 0])])
    tree += draft.forward(cache, [slot], [[6]], [[0]], trees=[(5, [-1, 0, 0, 0, 0, 4])])
    cache.truncate(slot, root + 4)
    tree += draft.forward(cache, [slot], [[5, 11]], [[0, 1]], trees=[(4, [-1, 0, 0, 0, 0, 0])])
    cache, slot = prefilled()
    alone = draft.forward(cache, [slot], [[5]], [[0]]) + draft.forward(cache, [slot], [[6]], [[0]])
    cache, slot = prefilled()
    alone += draft.forward(cache, [slot], [[5, 11]], [[0, 1]], trees=[(1, [-1, 0, 0])])
    return torch.cat(tree), torch.cat(alone)


@pytest.mark.parametrize("way", ["scripted", "native", "whole"])
def test_tree_passes_see_only_their_mask_on_every_path(tmp_path, model_dirs, prompt_ids, monkeypatch, way):
    """A tree pass takes the draft's fast paths (a fanout branch's one token included) and attends with its mask:
    its tokens' logits are those of the same passes with no chain past the root."""
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")
    monkeypatch.setenv(native_draft.OWN_ENV, "own" if way == "whole" else "torch")
    monkeypatch.setenv(lean_pass.ENV, "1" if way == "whole" else "0")
    if way == "whole" and not (few_rows.int8_available() and lean_pass.available()):
        pytest.skip("no whole lean pass over int8 weights here")
    draft = load_model(int8_draft_dir(tmp_path, model_dirs["llama"]))
    calls = _counted(monkeypatch)
    whole = []
    run = lean_pass.run
    monkeypatch.setattr(lean_pass, "run", lambda *a, **k: whole.append(a[0].shape[:2]) or run(*a, **k))
    draft.lean.native.override = way != "scripted"
    try:
        tree, alone = _tree_and_steps(draft, prompt_ids[0][:40])
    finally:
        draft.lean.native.override = None
    assert torch.allclose(tree, alone, atol=1e-4, rtol=0)
    assert torch.equal(tree.argmax(-1), alone.argmax(-1))
    # After each cache's prefill (which the eager layers make): the chain and three tree passes, then three passes.
    ran = {"scripted": calls + whole, "native": calls, "whole": whole}[way]
    assert len(ran) == (0 if way == "scripted" else 7)
