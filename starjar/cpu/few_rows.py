"""starjar's own float32 product for a few rows (native/few_rows.cpp): one path of starjar.cpu.skinny_linear.

MKL's sgemm reads the default target's weights more than once for some row counts: on a 2-core Intel Xeon
(AVX512) its 49k-wide output layer took 19.9 ms for 12 rows where one row took 4.0, and the body's layers
over 8 rows 41 ms against 20 for one. This product loads each tile of 4 weight rows once against every input
row, so the weights stream from memory once: 8.3 ms for those 12 rows and 30 ms for the 8 (same run,
tests/starjar/test_few_rows.py checks its values; skinny_linear times it against the other paths per row
bucket). Each output is summed in an order that does not depend on the rows or outputs beside it.

It is built once per machine (starjar.cpu.native_build, a few seconds); where it cannot be, skinny_linear does
not offer the path. STARJAR_FEW_ROWS_ISA=avx2|avx512 forces the kernel (tests force each this CPU has).

AVX-512's kernels read a tile's 4 weight rows interleaved or one after another (tiles.h, int8_tiles.h): the
same values either way, and which is faster depends on the CPU's prefetcher (on a 2-core AMD EPYC, Zen 4, one
row took about half the time streamed; many float rows were faster interleaved). settle_stream (float) and
settle_int8_stream (VNNI) time both over a model's own weights for 1..6 input rows once per machine (kernels'
cache) and hand the choice to the products and the lean pass as one mask: bit r - 1 streams the float
product for r rows, bit 6 + r - 1 the int8 one. For 7..12 rows settle_stream also times AVX-512's wide tiles (two
weight rows against every input row in one pass) against a 6-row pass and the rest: bit 12 + r - 7 takes them
for r rows. For the row counts it streams, it then times each thread walking two runs of its weight rows at once
(the two halves of its share, row beside row: tiles.h's twin512) against one: bit 18 + r - 1 twins r rows;
settle_int8_stream does the same for VNNI's streamed rows (int8_tiles.h's twin_rows): bit 24 + r - 1.
STARJAR_FEW_ROWS_STREAM=all|none|<mask> forces every bit (tests force each).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from starjar.cpu import kernels, native_build

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("native") / name for name in ("few_rows.cpp", "int8_rows.cpp")]
HEADERS = [Path(__file__).with_name("native") / name for name in ("tiles.h", "int8_tiles.h")]  # the lean pass shares
LIBRARY = "starjar_few_rows"
FLAGS = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for splits the tiles between the threads only with it
ISA_ENV = "STARJAR_FEW_ROWS_ISA"
ISAS = {"avx2": 1, "avx512": 2}  # the kernel's codes; 0 is the best this CPU has
STREAM_ENV = "STARJAR_FEW_ROWS_STREAM"
STREAM_ROWS = 6  # the kernels' input rows a pass: bit r - 1 of a stream mask streams float products for r rows
FLOAT_STREAMED = (1 << STREAM_ROWS) - 1
INT8_SHIFT = STREAM_ROWS  # bit INT8_SHIFT + r - 1 streams int8 products for r rows
WIDE_SHIFT = 2 * STREAM_ROWS  # bit WIDE_SHIFT + r - 7 takes the wide float tiles for r (7..12) rows
WIDE_ROWS = range(STREAM_ROWS + 1, 2 * STREAM_ROWS + 1)
TWIN_SHIFT = 3 * STREAM_ROWS  # bit TWIN_SHIFT + r - 1 walks two runs of weight rows at once for r streamed rows
INT8_TWIN_SHIFT = 4 * STREAM_ROWS  # the same for r streamed int8 rows
ALL_STREAMED = (1 << 5 * STREAM_ROWS) - 1
FLOAT_TWINNED = FLOAT_STREAMED << TWIN_SHIFT  # every float row count's twin bit
INT8_TWINNED = FLOAT_STREAMED << INT8_TWIN_SHIFT
TWINNED = FLOAT_TWINNED | INT8_TWINNED
# Two runs against one differ by a few percent at most, and single turns by up to 12% in a slow spell of a shared
# machine (2-core AMD EPYC, Zen 4): more turns than the other choices take.
TWIN_REPS = 7
_state: dict[str, object] = {}  # "ok", "why"; "isa": the code last handed to the kernel; "stream": the mask
_loading = threading.Lock()


def available() -> bool:
    """Whether the product is loaded in this process (built first where no build is kept) and this CPU has
    AVX2 with FMA at least."""
    with _loading:
        if "ok" not in _state:
            ok, why = (True, "") if hasattr(torch.ops.starjar, "few_rows") else native_build.load(
                LIBRARY, SOURCES, HEADERS, flags=FLAGS, ldflags=["-fopenmp"], what="the few-rows product")
            if ok and torch.ops.starjar.few_rows_isa() == 0:
                ok, why = False, "this CPU has neither AVX2 with FMA nor AVX-512"
            _state["ok"], _state["why"] = ok, why
            if not ok:
                log.warning("the few-rows product is unavailable (other paths run): %s", why)
        return bool(_state["ok"])


def isa() -> int:
    """The kernel STARJAR_FEW_ROWS_ISA forces (its code); else AVX2's where ATen is held to it (as
    scripts/emulate_isa.sh holds every library), else 0: the best this CPU has."""
    name = os.environ.get(ISA_ENV, "").strip().lower()
    if not name:
        return ISAS["avx2"] if _held_to_avx2() else 0
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV} must be one of {sorted(ISAS)}, not {name!r}")
    return ISAS[name]


def use_forced_isa() -> None:
    """Hand the kernel STARJAR_FEW_ROWS_ISA's choice (the native passes call the product without Python)."""
    code = isa()
    if _state.get("isa") != code:
        torch.ops.starjar.few_rows_use(code)
        _state["isa"] = code


def forced_stream() -> int | None:
    """The stream mask STARJAR_FEW_ROWS_STREAM forces (all, none or a number up to ALL_STREAMED), else None:
    measured."""
    name = os.environ.get(STREAM_ENV, "").strip().lower()
    if not name:
        return None
    if name in ("all", "none"):
        return ALL_STREAMED if name == "all" else 0
    if not name.isdigit() or int(name) > ALL_STREAMED:
        raise ValueError(f"{STREAM_ENV} must be all, none or a mask 0..{ALL_STREAMED}, not {name!r}")
    return int(name)


def stream_mask() -> int:
    """The stream mask in use in this process (0 until settle_stream or set_stream ran)."""
    return int(_state.get("stream", 0))


def set_stream(mask: int) -> None:
    """Hand the products a stream mask (the lean pass reads stream_mask() before each call)."""
    if available():
        torch.ops.starjar.few_rows_stream(mask)
    _state["stream"] = mask


def settle_stream(weights: list[torch.Tensor]) -> int:
    """This machine's stream bits for AVX-512's float products over these weights [N, K]: forced, cached, or
    timed now (a few seconds: the weights' products in turn, each way, for 1..6 rows, then wide or not for
    7..12, then two runs a thread or one for the streamed counts); handed to the product. Where AVX-512's kernel
    does not run they change nothing and stay 0. Returns the whole mask."""
    shapes = tuple(sorted({(int(w.shape[1]), int(w.shape[0])) for w in weights}))
    def run(w, rows, x):
        return torch.ops.starjar.few_rows(x[:rows], w, None)

    def width(w):
        return int(w.shape[1])

    set_stream(stream_mask() & ~FLOAT_TWINNED)  # streamed rows timed one run a thread, then twinned
    _settle(0, "fp32-stream", shapes, weights, run, width)
    _settle(WIDE_SHIFT, "fp32-wide", shapes, weights, run, width, WIDE_ROWS)
    return _settle_twin(0, TWIN_SHIFT, "fp32", shapes, weights, run, width)


def settle_int8_stream(laid: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """settle_stream for the int8 product over int8_layout's weights and meta (VNNI's kernel; AVX2's int8
    kernel always streams). Returns the whole mask."""
    vnni = int8_available() and bool(torch.ops.starjar.int8_rows_vnni())
    shapes = tuple(sorted({(int(w.shape[1]), int(w.shape[0])) for w, _ in laid})) if vnni else ()

    def run(wm, rows, x):
        return torch.ops.starjar.int8_rows(x[:rows], wm[0], wm[1], None)

    def width(wm):
        return int(wm[0].shape[1])

    set_stream(stream_mask() & ~INT8_TWINNED)  # as settle_stream: one run a thread, then twinned
    _settle(INT8_SHIFT, "int8-stream", shapes, laid, run, width)
    return _settle_twin(INT8_SHIFT, INT8_TWIN_SHIFT, "int8", shapes, laid, run, width)


def _settle_twin(stream_shift: int, twin_shift: int, kind: str, shapes: tuple, weights: list, run: Callable,
                 width: Callable) -> int:
    """The twin bits from twin_shift up, timed for the row counts the stream bits from stream_shift up stream (the
    others stay 0), cached under the streamed counts; returns the whole mask."""
    streamed = stream_mask() >> stream_shift & FLOAT_STREAMED
    rows = range(1, STREAM_ROWS + 1)
    return _settle(twin_shift, f"{kind}-twin-{streamed}", shapes, weights, run, width, rows,
                   only=[count for count in rows if streamed >> (count - 1) & 1])


def _settle(shift: int, kind: str, shapes: tuple, weights: list, run: Callable, width: Callable,
            rows: range = range(1, STREAM_ROWS + 1), only: list[int] | None = None) -> int:
    """Set the bits from `shift` up (one a row count of `rows`; where `only` is given, the other counts' bits
    stay 0 untimed): forced (the whole mask), cached or timed; returns the whole mask."""
    mask = forced_stream()
    if mask is None:
        runs_avx512 = available() and (isa() or torch.ops.starjar.few_rows_isa()) == ISAS["avx512"]
        bits = 0 if not runs_avx512 or not shapes else kernels.cached_entry(
            kind, shapes, lambda: _time_stream(shift, weights, run, width, rows, only, TWIN_REPS if only else 3),
            usable=lambda e: isinstance(e.get("mask"), int))["mask"]
        mask = stream_mask() & ~(FLOAT_STREAMED << shift) | bits << shift
    set_stream(mask)
    return mask


def _time_stream(shift: int, weights: list, run: Callable, width: Callable, rows: range,
                 only: list[int] | None = None, reps: int = 3) -> dict:
    """Each row count's products (those of `only`, where given) over every weight in turn (weights as cold as in
    a pass), without and with the bit (streamed weight rows for 1..6 rows; the wide tiles for 7..12; two runs a
    thread for streamed rows), in turns; the bits of the row counts that ran faster with it (bit i for the i-th
    row count)."""
    use_forced_isa()
    xs = {width(w): torch.randn(rows[-1], width(w)) for w in weights}
    others = stream_mask() & ~(FLOAT_STREAMED << shift)
    ms: list[dict] = []
    bits = 0
    without, with_bit = {WIDE_SHIFT: ("passes of 6", "wide"), TWIN_SHIFT: ("one run", "two runs"),
                         INT8_TWIN_SHIFT: ("one run", "two runs")}.get(shift, ("interleaved", "streamed"))
    with torch.inference_mode():
        for i, count in enumerate(rows):
            if only is not None and count not in only:
                ms.append({})
                continue

            def chain(on: bool, count: int = count, i: int = i) -> None:
                torch.ops.starjar.few_rows_stream(others | (1 << (shift + i) if on else 0))
                for w in weights:
                    run(w, count, xs[width(w)])
            off_ms, on_ms = (t * 1e3 for t in kernels.interleaved_medians([lambda: chain(False),
                                                                           lambda: chain(True)], reps))
            ms.append({without: round(off_ms, 3), with_bit: round(on_ms, 3)})
            if on_ms < off_ms:
                bits |= 1 << i
    torch.ops.starjar.few_rows_stream(stream_mask())
    log.info("AVX-512 %s products take %s for %s input rows (%s; ms %s)",
             "int8" if shift in (INT8_SHIFT, INT8_TWIN_SHIFT) else "float", with_bit,
             [c for i, c in enumerate(rows) if bits >> i & 1] or "no", kernels.machine_label(), ms)
    return {"mask": bits, "ms": ms}


def product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] float32 times w [N, K]^T, plus b: [R, N]."""
    use_forced_isa()
    return torch.ops.starjar.few_rows(x, w, b)


def int8_available() -> bool:
    """Whether starjar's own int8 product runs here: the library loaded, and AVX-512 VNNI or AVX2 (whose
    kernel gives the same sums; it runs where STARJAR_FEW_ROWS_ISA or ATen held to AVX2 asks for it)."""
    return available() and bool(torch.ops.starjar.int8_rows_available())


def _held_to_avx2() -> bool:
    return os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() == "avx2"


def int8_layout(packed) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torch's packed dynamic int8 weights (per output channel, symmetric) laid out for the own int8 product:
    int8 [N, K padded to a multiple of 64] and [2, N] float32 (each output's scale, the sum of its int8
    weights); None for weights it cannot take (nonzero zero points)."""
    w, _ = torch.ops.quantized.linear_unpack(packed)
    if w.qscheme() not in (torch.per_channel_affine, torch.per_channel_symmetric) or \
            bool((w.q_per_channel_zero_points() != 0).any()):
        return None
    ints = w.int_repr()
    n, k = ints.shape
    padded = torch.zeros(n, -(-k // 64) * 64, dtype=torch.int8)
    padded[:, :k] = ints
    return padded, torch.stack([w.q_per_channel_scales().float(), ints.sum(1).float()])


def int8_product(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] float32, quantized per row, times int8_layout's weights, plus b: [R, N]."""
    use_forced_isa()
    return torch.ops.starjar.int8_rows(x, w, meta, b)
