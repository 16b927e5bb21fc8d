"""Native passes, built once per machine: a target's chain pass over fused projections as one call
(native/target_pass.cpp), and the int8 draft's passes over consecutive slots as one call (native/draft_pass.cpp).

The scripted fused layers (starjar.model.target_step) dispatch about 45 small ops a layer from the TorchScript
interpreter. The native pass calls ATen for every sum (the products by the path each takes, RMSNorm's sum,
attention, SiLU) with the shapes the scripted layers give them and writes only the elementwise work between
them, each value rounded as ATen rounds it: its hidden states are the scripted layers' bit for bit. It runs the
one-row step and the chain passes over consecutive cache slots (verification, multi-row decoding). Measured on
the default target decoding alone (Intel Xeon, AVX512, 2 threads; python -m
benchmarks.probes.llama_cpp_reference --also-scripted): 29.0 tokens/s scripted, 31.7 native, in one run.
The draft's pass calls the packed int8 weights' own kernel the same way, its hidden states the scripted layers'
(starjar.model.lean_step) bit for bit.

The source is compiled the first time a process asks for it on a machine (starjar.cpu.native_build; about 15 s
on 2 cores); later processes load the built library. Where it cannot be built, the scripted layers run
(a warning says why). STARJAR_NATIVE_PASS=1 requires it, 0 keeps the scripted layers; unset,
starjar.model.lean_target takes it where it measured faster on the running machine.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from starjar.cpu import kernels, native_build

log = logging.getLogger(__name__)

ENV = "STARJAR_NATIVE_PASS"
SOURCES = tuple(Path(__file__).with_name("native") / name for name in ("target_pass.cpp", "draft_pass.cpp"))
HEADERS = (Path(__file__).with_name("native") / "pass_parts.h",)
LIBRARY = "starjar_native_passes"  # the built library's name
FLAGS = ["-O3", "-ffp-contract=off"]  # no product and sum fused into one rounding: ATen's values, bit for bit
_state: dict[str, object] = {}  # "ok": whether the library is loaded in this process; "why": the reason if not
_loading = threading.Lock()


def forced() -> bool | None:
    """What STARJAR_NATIVE_PASS forces: True (required), False (the scripted layers), None (measured)."""
    return kernels.forced_switch(ENV)


def required() -> bool | None:
    """forced(), with a forced pass that cannot be built an error that says why."""
    force = forced()
    if force and not available():
        raise RuntimeError(f"{ENV}=1, but the native pass could not be built: {unavailable_reason()}")
    return force


def available() -> bool:
    """Whether the native pass is loaded in this process, building it first where no build is kept."""
    with _loading:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _load()
            if not _state["ok"]:
                log.warning("native passes unavailable, the scripted layers run: %s", _state["why"])
        return bool(_state["ok"])


def unavailable_reason() -> str:
    return str(_state.get("why", ""))


def _load() -> tuple[bool, str]:
    if hasattr(torch.ops.starjar, "fused_pass") and hasattr(torch.ops.starjar, "draft_pass"):
        return True, ""
    return native_build.load(LIBRARY, SOURCES, HEADERS, FLAGS, what="the native passes")


def run(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, mask: torch.Tensor,
        flat_ws: list[torch.Tensor], flat_bs: list[torch.Tensor | None], packs: list[torch.Tensor | None],
        paths: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], start: int, kv_len: int,
        nq: list[int], nk: list[int], d: int, eps: float, scaling: float,
        write: torch.Tensor | None = None) -> torch.Tensor:
    """The fused layers' result over every layer (target_step._fused_step's for one row, _fused_rows_layer's in
    turn otherwise) with each layer's weights flattened (six a layer) and its biases, packed weights and product
    paths (four a layer: qkv, o, gate-up, down); the rows' K and V written as one span from `start`, or each
    token at its position in write [B, Q] (consecutive slots of unequal lengths)."""
    return torch.ops.starjar.fused_pass(x, cos, sin_signed, mask, flat_ws, flat_bs, packs, paths, keys, values,
                                        start, kv_len, nq, nk, d, eps, scaling, write)


def run_draft(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
              norms: list[torch.Tensor], packs: list, biases: list[torch.Tensor | None], reduce_range: bool,
              keys: list[torch.Tensor], values: list[torch.Tensor], start: int, nq: list[int], nk: list[int], d: int,
              eps: float, kv_len: int, write: torch.Tensor | None, real: torch.Tensor | None = None,
              padded: tuple[int, int] = (0, 0), own: tuple[list, list] | None = None) -> torch.Tensor:
    """lean_step's layers over rows on consecutive slots x [B, Q, H], every layer: mask as they attend with it
    (folded for grouped heads when Q > 1; None for a one-token step), norms two a layer, packs and biases four a
    layer (torch's packed int8 weights of qkv, o, gate-up and down, and their float biases); the rows' K and V
    written from `start`, or each token at its position in write [B, Q]; attention over kv_len positions. A
    padded pass: x, cos and sin hold its real tokens [T, 1, ...], real their indices in the flattened padded
    (B, Q). own: starjar's own int8 weights for every product (starjar.cpu.few_rows.int8_layout's, four a
    layer), where they replace torch's kernel."""
    return torch.ops.starjar.draft_pass(x, cos, sin, mask, norms, packs, biases, reduce_range, keys, values, start,
                                        nq, nk, d, eps, kv_len, write, real, *padded, *(own or (None, None)))


def takes(x: torch.Tensor) -> bool:
    """Whether the native pass computes this pass's values: float32 on the CPU."""
    return x.dtype == torch.float32 and x.device.type == "cpu"
