"""The native lean pass (native/lean_pass.cpp): a float Llama-family target's chain pass written whole, every
layer in one parallel region with starjar's own products, norms, rotation, attention and SiLU.

The native pass (starjar.model.native_pass) keeps HF's bits by calling ATen for every sum; between its products
that costs about a fifth of a default-target step on a 2-core Xeon (AVX512). This pass leaves only the products'
streaming, and orders its sums its own way: its values differ from HF's by rounding, so
starjar.model.lean_target takes it per pass class only where it measured faster, and the tests hold its greedy
output to HF generate()'s. STARJAR_LEAN_PASS=1 requires it wherever a native pass would run, 0 never takes it.

It is built once per machine (starjar.cpu.native_build) with OpenMP; where it cannot be built, or the CPU has
neither AVX2 with FMA nor AVX-512, the other passes run (a warning says why). Its kernels follow
STARJAR_FEW_ROWS_ISA and ATen held to AVX2, as the few-row product's do (starjar.cpu.few_rows.isa).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from starjar.cpu import few_rows, kernels, native_build

log = logging.getLogger(__name__)

ENV = "STARJAR_LEAN_PASS"
SOURCES = [Path(__file__).with_name("native") / "lean_pass.cpp"]
HEADERS = [*(Path(few_rows.__file__).with_name("native") / h for h in ("tiles.h", "int8_tiles.h")),
           Path(__file__).with_name("native") / "lean_avx2.h"]
LIBRARY = "starjar_lean_pass"
FLAGS = ["-O3", "-fopenmp"]
_state: dict[str, object] = {}  # "ok": loaded in this process; "why": the reason if not; "stream": the mask handed
_loading = threading.Lock()


def forced() -> bool | None:
    """What STARJAR_LEAN_PASS forces: True (required), False (never), None (measured)."""
    force = kernels.forced_switch(ENV)
    if force and not available():
        raise RuntimeError(f"{ENV}=1, but the lean pass could not be built: {_state.get('why', '')}")
    return force


def available() -> bool:
    """Whether the lean pass is loaded in this process (built first where no build is kept) and this CPU has
    AVX2 with FMA at least."""
    with _loading:
        if "ok" not in _state:
            ok, why = (True, "") if hasattr(torch.ops.starjar, "lean_pass") else native_build.load(
                LIBRARY, SOURCES, HEADERS, flags=FLAGS, ldflags=["-fopenmp"], what="the lean pass")
            if ok and torch.ops.starjar.lean_pass_isa() == 0:
                ok, why = False, "this CPU has neither AVX2 with FMA nor AVX-512"
            _state["ok"], _state["why"] = ok, why
            if not ok:
                log.warning("the lean pass is unavailable (the other passes run): %s", why)
        return bool(_state["ok"])


def run(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, mask: torch.Tensor | None,
        flat_ws: list[torch.Tensor], flat_bs: list[torch.Tensor | None], keys: list[torch.Tensor],
        values: list[torch.Tensor], start: int, kv_len: int, nq: list[int], nk: list[int], d: int, eps: float,
        scaling: float, write: torch.Tensor | None = None, int8: tuple[list, list] | None = None,
        norm: torch.Tensor | None = None) -> torch.Tensor:
    """The hidden states after every layer for x [B, Q, H] on consecutive slots, as native_pass.run takes them
    (six weights and four biases a layer over the fused projections; mask the pass's additive [B, 1, Q, K],
    not folded, or None where every key is visible). int8: the products in the own int8 layout
    (starjar.cpu.few_rows.int8_layout's weights and meta, four a layer), flat_ws then the two norms a layer.
    norm: the model's final RMSNorm weight (same epsilon), applied in the pass; None returns the last layer's."""
    mask_now = few_rows.stream_mask()
    if _state.get("stream") != mask_now:
        torch.ops.starjar.lean_pass_stream(mask_now)
        _state["stream"] = mask_now
    return torch.ops.starjar.lean_pass(x, cos, sin_signed, mask, flat_ws, flat_bs, keys, values, start, kv_len,
                                       nq, nk, d, eps, scaling, write, few_rows.isa(), *(int8 or (None, None)), norm)
