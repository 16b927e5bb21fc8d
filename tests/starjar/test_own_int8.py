"""starjar's own int8 product (starjar.cpu.few_rows.int8_product) and the int8 draft's native passes on it
(starjar.model.native_draft): exact sums of per-row quantized activations, chosen by measurement or forced, and
lossless through the engine."""

import kernel_isas
import pytest
import torch
import torch.nn.functional as F
from int8_drafts import int8_draft_dir

from benchmarks.fixtures.reference import hf_greedy
from controller.colocated import colocated_engine
from starjar.cpu import few_rows, kernels
from starjar.cpu.quantized import dynamic_int8
from starjar.model import native_draft
from starjar.model.loading import load_model
from starjar.spec.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not few_rows.int8_available(), reason="no AVX-512 VNNI or AVX2 here, or no build")
isa = kernel_isas.isa  # each kernel this CPU has, forced (a fixture)
HAS_VNNI = few_rows.int8_available() and torch.ops.starjar.int8_rows_vnni()


def _exact(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The product's definition, its sums in int64: each row quantized to 0..255 over [min(x, 0), max(x, 0)]."""
    lo, hi = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 255
    zero = torch.round(-lo / scale).clamp(0, 255)
    q = (torch.round(x * (1 / scale)) + zero).clamp(0, 255)
    sums = (q.long() @ w[:, : x.shape[1]].long().t()).float()
    out = (sums - zero * meta[1]) * scale * meta[0]
    return out if b is None else out + b


@pytest.mark.parametrize("k", [64, 100, 576])
def test_the_sums_are_exact_and_each_rows_own(k, isa):
    torch.manual_seed(k)
    layer = torch.nn.Linear(k, 300)
    w, meta = few_rows.int8_layout(dynamic_int8(layer)._packed_params._packed_params)
    assert w.shape == (300, -(-k // 64) * 64) and w.dtype == torch.int8
    x = torch.randn(13, k) * torch.logspace(-2, 2, 13).unsqueeze(1)  # rows of very different ranges
    y = few_rows.int8_product(x, w, meta, layer.bias.detach())
    assert torch.allclose(y, _exact(x, w, meta, layer.bias.detach()), rtol=1e-6, atol=1e-6)
    alone = torch.cat([few_rows.int8_product(x[i:i + 1], w, meta, None) for i in range(13)])
    assert torch.equal(few_rows.int8_product(x, w, meta, None), alone)
    ref = F.linear(x, layer.weight.detach())
    assert ((alone - ref).abs().amax(1) / ref.abs().amax(1)).max() < 0.03  # 8-bit rows, 8-bit weights
    # A row of one sign keeps all 256 levels over [0, max]: about half the error of a symmetric range.
    positive, wq = x.abs(), w[:, :k].float() * meta[0].unsqueeze(1)  # the int8 weights' own values
    exact = F.linear(positive, wq)
    peak = positive.amax(1, keepdim=True)
    symmetric = F.linear(torch.round(positive / peak * 127) * peak / 127, wq)
    own = few_rows.int8_product(positive, w, meta, None)
    assert (own - exact).abs().mean() < 0.75 * (symmetric - exact).abs().mean()


@pytest.mark.skipif(not HAS_VNNI, reason="no AVX-512 VNNI here: nothing to compare the AVX2 kernel with")
def test_the_avx2_kernel_gives_vnnis_bits(monkeypatch):
    """Without VNNI the sums are widened to 16 bits and multiplied in pairs: the same int32 sums, so the same
    outputs, for rows of every size a tile takes and K with padding."""
    torch.manual_seed(5)
    layer = torch.nn.Linear(100, 37)
    w, meta = few_rows.int8_layout(dynamic_int8(layer)._packed_params._packed_params)
    x = torch.randn(9, 100) * torch.logspace(-2, 2, 9).unsqueeze(1)
    vnni = few_rows.int8_product(x, w, meta, layer.bias.detach())
    monkeypatch.setenv(few_rows.ISA_ENV, "avx2")
    try:
        assert torch.equal(few_rows.int8_product(x, w, meta, layer.bias.detach()), vnni)
    finally:
        monkeypatch.delenv(few_rows.ISA_ENV)
        few_rows.use_forced_isa()


def _forced(monkeypatch, tmp_path, model_dirs, way: str):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_NATIVE_PASS", "1")
    monkeypatch.setenv("STARJAR_INT8_KERNEL", "fused")  # the products whose passes of several rows run natively
    monkeypatch.setenv(native_draft.OWN_ENV, way)
    return load_model(int8_draft_dir(tmp_path / way, model_dirs["llama"]))


def test_forced_own_drafts_close_to_torchs_kernel_and_stays_lossless(tmp_path, models, model_dirs, prompt_ids,
                                                                     monkeypatch):
    logits = {}
    for way in ("torch", "own"):
        draft = _forced(monkeypatch, tmp_path, model_dirs, way)
        cache = draft.new_cache()
        slots = [cache.allocate() for _ in range(3)]
        draft.forward(cache, slots, [p[:12] for p in prompt_ids[:3]], [[11]] * 3)
        logits[way] = torch.cat(draft.forward(cache, slots, [[5, 6], [7, 8], [9, 10]], [[0, 1]] * 3))
    assert not torch.equal(logits["own"], logits["torch"])  # another kernel ran
    scale = logits["torch"].abs().max()
    assert (logits["own"] - logits["torch"]).abs().max() < 0.1 * scale
    target = models["llama"]
    alone = [hf_greedy(target, p, 24) for p in prompt_ids[:6]]
    for gamma, batch in ((3, 1), (2, 4)):
        reqs = colocated_engine(target, draft, gamma, batch).generate(prompt_ids[:6], SamplingParams(max_tokens=24))
        assert [r.output_ids for r in reqs] == alone, (gamma, batch)


def test_the_own_choice_is_measured_once_and_cached(tmp_path, model_dirs, monkeypatch):
    monkeypatch.setenv("STARJAR_DRAFT_KV", "float32")
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(native_draft.OWN_ENV, raising=False)
    monkeypatch.delenv("STARJAR_NATIVE_PASS", raising=False)
    measured = []
    real = native_draft.NativeDraftPass._two_ways
    monkeypatch.setattr(native_draft.NativeDraftPass, "_two_ways",
                        lambda self, probe, attr, *names: measured.append(attr) or real(self, probe, attr, *names, 3))
    for i in range(2):
        kernels._entries.clear()
        draft = load_model(int8_draft_dir(tmp_path / str(i), model_dirs["llama"]))
        assert draft.lean.native.own_chosen is not None
    assert measured == ["own_override"]
    entry = next(e for name, e in kernels.cached_entries().items() if native_draft.OWN_KIND in name)
    assert entry["own"] == draft.lean.native.own_chosen
    assert all(set(ms) == {"torch", "own"} for ms in entry["ms"].values())


def test_a_bad_forced_value_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(native_draft.OWN_ENV, "fastest")
    with pytest.raises(ValueError, match="own"):
        native_draft.own_forced()


@pytest.mark.skipif(not HAS_VNNI, reason="no AVX-512 VNNI here: its weight rows are only ever streamed")
@pytest.mark.parametrize("bits,twin", [(1, 0), (0b010110, 0), (few_rows.FLOAT_STREAMED, 0), (1, 1),
                                       (0b010110, 0b010010), (few_rows.FLOAT_STREAMED, few_rows.FLOAT_STREAMED)])
@pytest.mark.parametrize("threads", [1, 2])
def test_vnnis_streamed_twinned_and_interleaved_weight_rows_give_the_same_bits(monkeypatch, bits, twin, threads):
    """VNNI's weight rows streamed one at a time for the row counts the mask names (bits 6-11), two runs of them a
    thread at once where bits 24-29 say so too, interleaved for the rest: every row's values equal the
    all-interleaved product's, alone or batched, with shares of odd and even lengths."""
    monkeypatch.delenv(few_rows.ISA_ENV, raising=False)
    before, held = few_rows.stream_mask(), torch.get_num_threads()
    torch.manual_seed(6)
    layer = torch.nn.Linear(130, 41)
    w, meta = few_rows.int8_layout(dynamic_int8(layer)._packed_params._packed_params)
    x = torch.randn(13, 130)
    try:
        torch.set_num_threads(threads)
        few_rows.set_stream(0)
        reference = few_rows.int8_product(x, w, meta, layer.bias.detach())
        few_rows.set_stream(bits << few_rows.INT8_SHIFT | twin << few_rows.INT8_TWIN_SHIFT)
        for rows in range(1, 14):
            assert torch.equal(few_rows.int8_product(x[:rows], w, meta, layer.bias.detach()), reference[:rows])
    finally:
        few_rows.set_stream(before)
        torch.set_num_threads(held)


@pytest.mark.skipif(not HAS_VNNI, reason="no AVX-512 VNNI here: its weight rows are only ever streamed")
def test_the_int8_stream_bits_are_measured_once_cached_and_leave_the_float_bits(monkeypatch, tmp_path):
    import json
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.delenv(few_rows.STREAM_ENV, raising=False)
    monkeypatch.delenv(few_rows.ISA_ENV, raising=False)
    monkeypatch.setattr(kernels, "_entries", {})
    before = few_rows.stream_mask()
    laid = [few_rows.int8_layout(dynamic_int8(torch.nn.Linear(k, n))._packed_params._packed_params)
            for k, n in ((128, 256), (256, 64))]
    try:
        few_rows.set_stream(0b100001)
        mask = few_rows.settle_int8_stream(laid)
        assert mask & few_rows.FLOAT_STREAMED == 0b100001 and few_rows.stream_mask() == mask
        stored = (tmp_path / "kernels.json").read_text()
        entry = next(e for name, e in json.loads(stored).items() if "|int8-stream|" in name)
        assert entry["mask"] == mask >> few_rows.INT8_SHIFT & few_rows.FLOAT_STREAMED
        assert len(entry["ms"]) == few_rows.STREAM_ROWS
        # Then two runs a thread timed against one, for the streamed row counts alone.
        streamed = entry["mask"]
        twin = next(e for name, e in json.loads(stored).items() if f"|int8-twin-{streamed}|" in name)
        assert twin["mask"] == mask >> few_rows.INT8_TWIN_SHIFT and twin["mask"] & ~streamed == 0
        assert [bool(ms) for ms in twin["ms"]] == [bool(streamed >> i & 1) for i in range(few_rows.STREAM_ROWS)]
        monkeypatch.setattr(kernels, "_entries", {})
        assert few_rows.settle_int8_stream(laid) == mask
        assert (tmp_path / "kernels.json").read_text() == stored  # read, not measured again
    finally:
        few_rows.set_stream(before)
