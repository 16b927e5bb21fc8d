"""starjar's own float32 product for a few rows (native/few_rows.cpp): one path of starjar.cpu.skinny_linear.

MKL's sgemm reads the default target's weights more than once for some row counts: on a 2-core Intel Xeon
(AVX512) its 49k-wide output layer took 19.9 ms for 12 rows where one row took 4.0, and the body's layers
over 8 rows 41 ms against 20 for one. This product loads each tile of 4 weight rows once against every input
row, so the weights stream from memory once: 8.3 ms for those 12 rows and 30 ms for the 8 (same run,
tests/starjar/test_few_rows.py checks its values; skinny_linear times it against the other paths per row
bucket). Each output is summed in an order that does not depend on the rows or outputs beside it.

It is built once per machine (starjar.cpu.native_build, a few seconds); where it cannot be, skinny_linear does
not offer the path. STARJAR_FEW_ROWS_ISA=avx2|avx512 forces the kernel (tests force each this CPU has).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from starjar.cpu import native_build

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("native") / name for name in ("few_rows.cpp", "int8_rows.cpp")]
HEADERS = [Path(__file__).with_name("native") / name for name in ("tiles.h", "int8_tiles.h")]  # the lean pass shares
LIBRARY = "starjar_few_rows"
FLAGS = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for splits the tiles between the threads only with it
ISA_ENV = "STARJAR_FEW_ROWS_ISA"
ISAS = {"avx2": 1, "avx512": 2}  # the kernel's codes; 0 is the best this CPU has
_state: dict[str, object] = {}  # "ok", "why"; "isa": the code last handed to the kernel
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
