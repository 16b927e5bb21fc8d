"""starjar's own few-rows product (starjar.cpu.few_rows), each kernel this CPU has forced in turn: F.linear's
values, and each output's sum independent of the rows, outputs and threads beside it."""

import json

import kernel_isas
import pytest
import torch

from starjar.cpu import few_rows

pytestmark = pytest.mark.skipif(not few_rows.available(), reason="starjar's few-rows product could not be built")
isa = kernel_isas.isa  # each kernel this CPU has, forced (a fixture)


@pytest.mark.parametrize("k", [1, 7, 15, 16, 17, 24, 37, 576])
def test_values_are_f_linears_with_every_tail(isa, k):
    torch.manual_seed(k)
    for rows, n in ((1, 1), (2, 5), (4, 3), (5, 2), (6, 9), (7, 33), (13, 4)):
        x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
        exact = (x.double() @ w.double().t() + b.double()).float()
        assert torch.allclose(few_rows.product(x, w, b), exact, atol=1e-5 * k ** 0.5, rtol=1e-5)
        assert torch.allclose(few_rows.product(x, w, None), exact - b, atol=1e-5 * k ** 0.5, rtol=1e-4)


def test_a_rows_values_do_not_depend_on_the_rows_beside_it(isa):
    """One row alone, or among 2 to 16 others in any place: the same bits (decoding alone equals batched)."""
    torch.manual_seed(1)
    w, b = torch.randn(300, 200), torch.randn(300)
    xs = torch.randn(16, 200)
    alone = torch.cat([few_rows.product(xs[i:i + 1], w, b) for i in range(16)])
    for rows in (2, 3, 6, 7, 12, 16):
        assert torch.equal(few_rows.product(xs[:rows], w, b), alone[:rows]), rows
    assert torch.equal(few_rows.product(xs.flip(0), w, b), alone.flip(0))


def test_an_outputs_values_do_not_depend_on_the_outputs_beside_it(isa):
    """q, k and v as one product give the three products' bits (the fused projections rely on it)."""
    torch.manual_seed(2)
    x = torch.randn(5, 96)
    wq, wk, wv = torch.randn(96, 96), torch.randn(31, 96), torch.randn(31, 96)
    fused = few_rows.product(x, torch.cat((wq, wk, wv)), None)
    apart = torch.cat([few_rows.product(x, w, None) for w in (wq, wk, wv)], dim=1)
    assert torch.equal(fused, apart)


def test_the_thread_count_does_not_change_the_values(isa):
    torch.manual_seed(3)
    x, w = torch.randn(9, 130), torch.randn(1001, 130)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = few_rows.product(x, w, None)
        torch.set_num_threads(2)
        assert torch.equal(few_rows.product(x, w, None), one)
    finally:
        torch.set_num_threads(threads)


def test_a_bad_or_missing_kernel_is_refused(monkeypatch):
    monkeypatch.setenv(few_rows.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="avx2"):
        few_rows.isa()
    if torch.ops.starjar.few_rows_isa() < few_rows.ISAS["avx512"]:
        with pytest.raises(RuntimeError, match="lacks the instructions"):
            torch.ops.starjar.few_rows_use(few_rows.ISAS["avx512"])
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.starjar.few_rows(torch.randn(2, 3).double(), torch.randn(4, 3).double())


def test_an_aten_held_to_avx2_holds_the_own_products_to_it(monkeypatch):
    """scripts/emulate_isa.sh avx2 holds ATen, oneDNN, fbgemm and MKL to AVX2: the own products follow."""
    monkeypatch.delenv(few_rows.ISA_ENV, raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert few_rows.isa() == few_rows.ISAS["avx2"]  # the int8 product too: AVX2's tiles, not VNNI's
    monkeypatch.setenv(few_rows.ISA_ENV, "avx512")  # a forced kernel still wins
    assert few_rows.isa() == few_rows.ISAS["avx512"]


avx512 = pytest.mark.skipif(not few_rows.available() or torch.ops.starjar.few_rows_isa() < few_rows.ISAS["avx512"],
                            reason="this CPU lacks AVX-512")


@avx512
@pytest.mark.parametrize("mask", [0, 1, 0b101010, 0b011001 << few_rows.WIDE_SHIFT,
                                  0b110011 | 0b100101 << few_rows.TWIN_SHIFT, few_rows.ALL_STREAMED])
def test_streamed_and_interleaved_weight_rows_give_the_same_bits(monkeypatch, mask):
    """AVX-512's weight rows streamed one at a time for the row counts a mask names (two runs a thread at once
    where it names them twinned too), interleaved for the rest, and the wide tiles for the counts over 6 it names:
    every row's values equal the all-interleaved product's, so a row alone (1 row streamed) equals it batched. 301
    outputs end on a tile of one weight row, so a thread's second half of its share is a row short of its first."""
    monkeypatch.setenv(few_rows.ISA_ENV, "avx512")
    before = few_rows.stream_mask()
    torch.manual_seed(4)
    w, b = torch.randn(301, 37), torch.randn(301)
    xs = torch.randn(13, 37)
    try:
        few_rows.set_stream(0)
        reference = few_rows.product(xs, w, b)
        few_rows.set_stream(mask)
        for rows in range(1, 14):
            assert torch.equal(few_rows.product(xs[:rows], w, b), reference[:rows]), rows
        assert torch.equal(few_rows.product(xs[5:6], w, b), reference[5:6])
    finally:
        few_rows.set_stream(before)


@avx512
def test_the_stream_mask_is_measured_once_and_cached(monkeypatch, tmp_path):
    from starjar.cpu import kernels
    monkeypatch.setenv("STARJAR_HOME", str(tmp_path))
    monkeypatch.delenv(few_rows.STREAM_ENV, raising=False)
    monkeypatch.delenv(few_rows.ISA_ENV, raising=False)
    monkeypatch.setattr(kernels, "_entries", {})
    before = few_rows.stream_mask()
    weights = [torch.randn(256, 64), torch.randn(64, 256)]
    try:
        few_rows.set_stream(0b101 << few_rows.INT8_SHIFT)
        mask = few_rows.settle_stream(weights)
        assert 0 <= mask <= few_rows.ALL_STREAMED and few_rows.stream_mask() == mask
        assert mask >> few_rows.INT8_SHIFT & few_rows.FLOAT_STREAMED == 0b101  # the int8 bits left as they were
        stored = (tmp_path / "kernels.json").read_text()
        entry = next(e for name, e in json.loads(stored).items() if "|fp32-stream|" in name)
        assert entry["mask"] == mask & few_rows.FLOAT_STREAMED and len(entry["ms"]) == few_rows.STREAM_ROWS
        assert set(entry["ms"][0]) == {"interleaved", "streamed"}
        wide = next(e for name, e in json.loads(stored).items() if "|fp32-wide|" in name)
        assert wide["mask"] == mask >> few_rows.WIDE_SHIFT & few_rows.FLOAT_STREAMED
        assert len(wide["ms"]) == len(few_rows.WIDE_ROWS) and set(wide["ms"][0]) == {"passes of 6", "wide"}
        streamed = mask & few_rows.FLOAT_STREAMED  # two runs a thread are timed only for the streamed row counts
        twin = next(e for name, e in json.loads(stored).items() if f"|fp32-twin-{streamed}|" in name)
        assert twin["mask"] == mask >> few_rows.TWIN_SHIFT and twin["mask"] & ~streamed == 0
        assert [bool(ms) for ms in twin["ms"]] == [bool(streamed >> i & 1) for i in range(few_rows.STREAM_ROWS)]
        assert all(set(ms) == {"one run", "two runs"} for ms in twin["ms"] if ms)
        monkeypatch.setattr(kernels, "_entries", {})
        assert few_rows.settle_stream(weights) == mask
        assert (tmp_path / "kernels.json").read_text() == stored  # read, not measured again
    finally:
        few_rows.set_stream(before)


def test_a_forced_stream_mask_wins_and_a_bad_one_is_refused(monkeypatch):
    before = few_rows.stream_mask()
    try:
        for value, mask in (("all", few_rows.ALL_STREAMED), ("none", 0), ("5", 5)):
            monkeypatch.setenv(few_rows.STREAM_ENV, value)
            assert few_rows.settle_stream([torch.randn(8, 8)]) == mask == few_rows.stream_mask()
        for bad in (str(few_rows.ALL_STREAMED + 1), "some", "-1"):
            monkeypatch.setenv(few_rows.STREAM_ENV, bad)
            with pytest.raises(ValueError, match=f"all, none or a mask 0..{few_rows.ALL_STREAMED}"):
                few_rows.settle_stream([torch.randn(8, 8)])
        if few_rows.available():
            with pytest.raises(RuntimeError, match="1..6 rows"):
                torch.ops.starjar.few_rows_stream(few_rows.ALL_STREAMED + 1)
    finally:
        few_rows.set_stream(before)
