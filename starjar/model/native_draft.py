"""The int8 draft's one-token step as one native call (native/draft_step.cpp, built by starjar.model.native_pass),
where it measured faster than the scripted step (starjar.model.lean_step) on the running machine.

The scripted step's four int8 products per layer run near the memory floor; the ~35 small ops around them are
most of its time. Measured on the default pair's draft (2-core Intel Xeon, AVX512): a 13 ms step under the
profiler, 5.2 ms of it products. The native step calls the same kernels (the packed weights' own, ATen's
attention and SiLU) and writes the elementwise work between them in the scripted order: the hidden states are
the scripted step's bit for bit. STARJAR_NATIVE_PASS forces it as it does the target's (1 required, 0 off).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from starjar.cpu import kernels
from starjar.model import native_pass

log = logging.getLogger(__name__)

KIND = "native-draft-step"  # the kernel cache's entries of the native-or-scripted choice
CONTEXT = 128  # the probe's cached positions, a typical short context


class NativeDraftStep:
    """A draft's weights laid out for native_pass.run_draft, and whether its one-token steps take it."""

    def __init__(self, plan: list, head_dim: int, eps: float):
        """plan: LeanDecoder's, one entry a layer (its four linears scriptable, one reduce_range)."""
        self.norms = [t for p in plan for t in (p[0], p[6])]
        self.packs = [lin._packed for p in plan for lin in (p[1], p[5], p[7], p[9])]
        self.reduce_range = bool(plan[0][1]._reduce_range) if plan else False
        self.nq, self.nk = [p[3] for p in plan], [p[4] for p in plan]
        self.shapes = tuple((lin.in_features, lin.out_features) for lin in (plan[0][1], plan[0][5], plan[0][7],
                                                                            plan[0][9])) if plan else ()
        self.d, self.eps = head_dim, eps
        self.chosen: bool | None = None  # measured on this machine (None: not yet)
        self.override: bool | None = None  # set while it is measured

    def takes(self, x: torch.Tensor, keys: list[torch.Tensor], probe: Callable[[bool], Callable[[], object]]) -> bool:
        """Whether this one-token step runs natively: float32 states and cache, and forced, or measured faster
        (probe(native) gives a function running one step either way; the choice is cached per machine)."""
        if not self.packs or not native_pass.takes(x) or keys[0].dtype != torch.float32:
            return False
        if self.override is not None:
            return self.override and native_pass.available()
        force = native_pass.forced()
        if force is False:
            return False
        if force and not native_pass.available():
            raise RuntimeError(f"{native_pass.ENV}=1, but the native passes could not be built: "
                               f"{native_pass.unavailable_reason()}")
        if self.chosen is None:
            self.chosen = native_pass.available() and self._measured(probe)
        return bool(force) or self.chosen

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
            values: list[torch.Tensor], start: int) -> torch.Tensor:
        return native_pass.run_draft(x, cos, sin, self.norms, self.packs, self.reduce_range, keys, values, start,
                                     self.nq, self.nk, self.d, self.eps)

    def _measured(self, probe: Callable[[bool], Callable[[], object]]) -> bool:
        entry = kernels.cached_entry(f"{KIND}-{len(self.nq)}-layers", self.shapes, lambda: self._measure(probe),
                                     usable=lambda e: isinstance(e.get("native"), bool))
        return bool(entry["native"])

    def _measure(self, probe: Callable[[bool], Callable[[], object]], reps: int = 7) -> dict:
        """One-token steps after CONTEXT positions, scripted and native in turns; native where faster."""
        scripted_s, native_s = kernels.interleaved_medians([probe(False), probe(True)], reps)
        ms = {"scripted": round(scripted_s * 1000, 3), "native": round(native_s * 1000, 3)}
        log.info("native draft step (%s): %s (measured: %s ms)", kernels.machine_label(), native_s < scripted_s, ms)
        return {"native": native_s < scripted_s, "ms": ms}
