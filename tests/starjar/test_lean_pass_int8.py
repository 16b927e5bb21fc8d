"""The whole lean pass over the int8 draft's own int8 weights (starjar.model.native_draft, starjar.model.lean_pass):
close to the native pass on the same products, lossless through the engine, chosen by measurement or forced."""

import pytest
import torch
from int8_drafts import int8_draft_dir

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import colocated_engine
from starjar.cpu import few_rows, kernels
from starjar.model import lean_pass, native_draft
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not few_rows.int8_available(), reason="no AVX-512 VNNI or AVX2 here, or no build")


def _draft(monkeypatch, tmp_path, model_dirs, whole: str):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_NATIVE_PASS", "1")
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")  # the products whose passes of several rows run natively
    monkeypatch.setenv(native_draft.OWN_ENV, "own")
    monkeypatch.setenv(lean_pass.ENV, whole)
    return load_model(int8_draft_dir(tmp_path / whole, model_dirs["llama"]))


def _passes(draft, prompts) -> torch.Tensor:
    """A step, a catch-up of three tokens and a batched step of three rows of unequal lengths."""
    cache = draft.new_cache()
    slots = [cache.allocate() for _ in range(3)]
    draft.forward(cache, slots, [p[:12] for p in prompts[:2]] + [prompts[2][:9]], [[11], [11], [8]])
    out = draft.forward(cache, slots[:1], [[5]], [[0]])
    out += draft.forward(cache, slots[:1], [[6, 7, 8]], [[0, 1, 2]])
    out += draft.forward(cache, slots, [[9], [10], [11]], [[0]] * 3)
    return torch.cat(out)


def test_the_int8_whole_pass_is_close_to_the_native_one_on_the_same_products(tmp_path, model_dirs, prompt_ids,
                                                                             monkeypatch):
    calls = []
    run = lean_pass.run
    monkeypatch.setattr(lean_pass, "run", lambda *a, **k: calls.append(a[0].shape[:2]) or run(*a, **k))
    native = _passes(_draft(monkeypatch, tmp_path, model_dirs, "0"), prompt_ids)
    assert calls == []
    whole = _passes(_draft(monkeypatch, tmp_path, model_dirs, "1"), prompt_ids)
    assert calls[-3:] == [(1, 1), (1, 3), (3, 1)]
    # The rows' int8 quantization sees states that differ by rounding, so a level may flip: close, not equal.
    assert (whole - native).abs().max() < 0.05 * native.abs().max()


@pytest.mark.parametrize("gamma,batch", [(3, 1), (2, 4)])
def test_drafting_with_it_keeps_the_output_the_targets(tmp_path, models, model_dirs, prompt_ids, monkeypatch, gamma,
                                                       batch):
    draft = _draft(monkeypatch, tmp_path, model_dirs, "1")
    target = models["llama"]
    alone = [hf_greedy(target, p, 24) for p in prompt_ids[:6]]
    engine = colocated_engine(target, draft, gamma, batch)
    reqs = engine.generate(prompt_ids[:6], SamplingParams(max_tokens=24))
    assert [r.output_ids for r in reqs] == alone
    assert engine.stats.accepted_tokens > 0


def test_the_choice_is_measured_once_and_cached(tmp_path, model_dirs, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path / "home"))
    for env in (lean_pass.ENV, native_draft.OWN_ENV, "STARJAR_NATIVE_PASS"):
        monkeypatch.delenv(env, raising=False)
    measured = []
    real = native_draft.NativeDraftPass._two_ways
    monkeypatch.setattr(native_draft.NativeDraftPass, "_two_ways",
                        lambda self, probe, attr, *names: measured.append(attr) or real(self, probe, attr, *names, 3))
    for i in range(2):
        kernels._entries.clear()
        draft = load_model(int8_draft_dir(tmp_path / str(i), model_dirs["llama"]))
        assert draft.lean.native.whole_chosen is not None
    assert measured.count("whole_override") == 1
    entry = next(e for name, e in kernels.cached_entries().items() if native_draft.WHOLE_KIND in name)
    assert entry["whole"] == draft.lean.native.whole_chosen
    assert all(set(ms) == {"native", "whole"} for ms in entry["ms"].values())


def test_a_prefill_past_the_whole_pass_s_rows_keeps_the_native_pass(tmp_path, model_dirs, monkeypatch):
    """The whole pass is chosen on few-token probes: a prompt's prefill past WHOLE_MAX_ROWS takes the native pass
    unless the lean pass is forced."""
    draft = _draft(monkeypatch, tmp_path, model_dirs, "1")
    monkeypatch.delenv(lean_pass.ENV)
    nd = draft.lean.native
    monkeypatch.setattr(nd, "whole_chosen", dict.fromkeys(native_draft.PROBES, True))
    assert nd._takes_whole(1, 3) and nd._takes_whole(1, native_draft.WHOLE_MAX_ROWS)
    assert not nd._takes_whole(1, native_draft.WHOLE_MAX_ROWS + 1)
    monkeypatch.setenv(lean_pass.ENV, "1")
    assert nd._takes_whole(1, native_draft.WHOLE_MAX_ROWS + 1)


@pytest.mark.skipif(not few_rows.int8_available() or not torch.ops.starjar.int8_rows_vnni(),
                    reason="no AVX-512 VNNI here: its weight rows are only ever streamed")
def test_streamed_weight_rows_give_the_interleaved_pass_s_bits(tmp_path, model_dirs, prompt_ids, monkeypatch):
    """The whole int8 pass with every product's weight rows streamed two runs a thread at once (the gate and up
    halves side by side too), streamed one run a thread, then interleaved, and twinned on one thread: the int32
    sums are exact and the float ones keep their order, so the same bits."""
    before, threads = few_rows.stream_mask(), torch.get_num_threads()
    outs = {}
    try:
        for way in ("all", str(few_rows.ALL_STREAMED & ~few_rows.TWINNED), "none", "all-1"):
            monkeypatch.setenv(few_rows.STREAM_ENV, way.removesuffix("-1"))
            torch.set_num_threads(1 if way.endswith("-1") else threads)
            outs[way] = _passes(_draft(monkeypatch, tmp_path / way, model_dirs, "1"), prompt_ids)
            assert few_rows.stream_mask() == {"all": few_rows.ALL_STREAMED, "none": 0}.get(
                way.removesuffix("-1"), few_rows.ALL_STREAMED & ~few_rows.TWINNED)
    finally:
        few_rows.set_stream(before)
        torch.set_num_threads(threads)
    assert all(torch.equal(outs["none"], out) for out in outs.values())
