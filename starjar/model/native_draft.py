"""The int8 draft's passes over consecutive cache slots as one native call (native/draft_pass.cpp, built by
starjar.model.native_pass): the one-token step, the catch-up over a few tokens and batched drafting, where each
measured faster than the scripted layers (starjar.model.lean_step) on the running machine.

The scripted layers' four int8 products per layer run near the memory floor; the ~35 small ops around them are
most of their time. Measured on the default pair's draft (2-core Intel Xeon, AVX512): a 13 ms one-token step under
the profiler, 5.2 ms of it products. The native pass calls the same kernels (the packed weights' own with the
same row scaling, ATen's attention and SiLU) and writes the elementwise work between them in the scripted order:
its hidden states are the scripted layers' bit for bit. A one-token step went from 12.6 to 8.8 ms, and speculation
at batch 1 gained 1.06-1.26x over the scripted draft at gamma 2-4 (python -m benchmarks.probes.native_draft_speed,
same machine, in turns). STARJAR_NATIVE_PASS forces it as it does the target's (1 required, 0 off).

Where the CPU has AVX-512 VNNI or AVX2, the native pass may take starjar's own int8 product instead of torch's
(starjar.cpu.few_rows: rows quantized each by its own peak, weights streamed once for a few rows), chosen per
pass class by measurement; STARJAR_DRAFT_INT8=own|torch forces it. The draft's values then differ from the
scripted layers' (a draft only proposes: verification keeps the output the target's own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from starjar.cpu import few_rows, huge_pages, kernels
from starjar.model import lean_pass, native_pass
from starjar.model.attention import fold_mask

log = logging.getLogger(__name__)

KIND = "native-draft-pass"  # the kernel cache's entries of the native-or-scripted choice
OWN_KIND = "own-int8-draft"  # those of the own-or-torch int8 product choice
WHOLE_KIND = "lean-pass-int8-draft"  # those of the whole-lean-pass choice (starjar.model.lean_pass)
OWN_ENV = "STARJAR_DRAFT_INT8"
CONTEXT = 128  # the probe's cached positions, a typical short context
# The passes timed, (rows, tokens): a one-token step, a catch-up, batched drafting.
PROBES = {"step": (1, 1), "span": (1, 3), "rows": (4, 1)}
# The whole lean pass is chosen on these few-token probes; past this many rows (a prompt's prefill) its own int8
# tiles run out of the memory-bound regime they were measured in (AVX2 EPYC: a 181-token prefill took 0.5 s
# there), so the native pass over torch's kernel takes it unless the lean pass is forced.
WHOLE_MAX_ROWS = 64
Probe = Callable[[int, int, bool], Callable[[], object]]  # (rows, tokens, native) -> a function running one pass


class NativeDraftPass:
    """A draft's weights laid out for native_pass.run_draft, and which of its passes take it."""

    def __init__(self, plan: list, biases: list, head_dim: int, eps: float, spans: bool):
        """plan and biases: LeanDecoder's, one entry a layer (its four linears in torch's int8 kernel, one
        reduce_range); spans: whether passes of several rows or tokens may run natively (their linears'
        multi-row path is the row-scaled kernel, which the native pass runs)."""
        self.norms = [t for p in plan for t in (p[0], p[6])]
        self.packs = [lin._packed for p in plan for lin in (p[1], p[5], p[7], p[9])]
        self.biases = [b for layer in biases for b in layer]
        self.reduce_range = bool(plan[0][1]._reduce_range) if plan else False
        self.nq, self.nk = [p[3] for p in plan], [p[4] for p in plan]
        self.shapes = tuple((lin.in_features, lin.out_features) for lin in (plan[0][1], plan[0][5], plan[0][7],
                                                                            plan[0][9])) if plan else ()
        self.d, self.eps = head_dim, eps
        self.scaling = float(plan[0][2].scaling) if plan else 1.0
        self.spans = spans and len({q // k for q, k in zip(self.nq, self.nk, strict=True)}) == 1  # one folded mask
        self.chosen: dict[str, bool] | None = None  # measured on this machine (None: not yet)
        self.override: bool | None = None  # set while it is measured, and by tests
        self.own_chosen: dict[str, bool] | None = None  # the own int8 product, per pass class (None: not yet)
        self.own_override: bool | None = None  # set while that is measured
        self._own: tuple[list, list] | None = None  # the weights laid out for it, once
        self.whole_chosen: dict[str, bool] | None = None  # the whole lean pass over those weights, per class
        self.whole_override: bool | None = None  # set while that is measured

    def usable(self, x: torch.Tensor, keys: list[torch.Tensor]) -> bool:
        """Whether the native pass can compute this pass: float32 states and cache, and for several rows or
        tokens the row-scaled products and one group size."""
        return bool(self.packs) and native_pass.takes(x) and keys[0].dtype == torch.float32 and \
            (x.shape[0] * x.shape[1] == 1 or self.spans)

    def takes(self, x: torch.Tensor, keys: list[torch.Tensor], probe: Probe) -> bool:
        """Whether this pass over consecutive slots runs natively: usable, and forced, or measured faster (probe;
        the choice is cached per machine)."""
        if not self.usable(x, keys):
            return False
        if self.override is not None:
            return self.override and native_pass.available()
        force = native_pass.required()
        if force is not None:
            return force
        self.settle(probe)
        return bool(self.chosen and self.chosen[pass_class(x.shape[0], x.shape[1])])

    def settle(self, probe: Probe) -> None:
        """Build, load and measure now (at load, not in a served step), unless forced or done."""
        if self.chosen is None and self.packs and native_pass.forced() is None:
            self.chosen = self._measured(probe) if native_pass.available() else dict.fromkeys(PROBES, False)
        if self.own_chosen is None and self.packs and own_forced() is None and native_pass.forced() is not False:
            self.own_chosen = self._own_measured(probe) if self._own_weights() else dict.fromkeys(PROBES, False)
        if self.whole_chosen is None and self.packs and lean_pass.forced() is None and \
                native_pass.forced() is not False and own_forced() is not False:
            whole = self._own_weights() is not None and lean_pass.available()
            self.whole_chosen = self._whole_measured(probe) if whole else dict.fromkeys(PROBES, False)
        if not any((self.own_chosen or {}).values()) and not any((self.whole_chosen or {}).values()) and \
                not own_forced() and not lean_pass.forced():
            self._own = None  # its copy of the int8 weights is not kept where no pass takes it

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
            keys: list[torch.Tensor], values: list[torch.Tensor], write: torch.Tensor | None, start: int,
            kv_len: int, real: torch.Tensor | None = None, padded: tuple[int, int] | None = None,
            tree: bool = False) -> torch.Tensor:
        """mask: the pass's [B, 1, Q, K], folded here as the scripted layers fold it (a one-token step needs
        none, unless it is a token tree's: tree); keys, values, write, start and kv_len: the cache's pass views for
        rows on consecutive slots; real and padded: a padded pass's real tokens (x, cos and sin hold those alone)
        and its (B, Q)."""
        b, q = padded if real is not None else x.shape[:2]
        masked = tree or b * q > 1
        if real is None and self._takes_whole(b, q):
            half = self.d // 2
            sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            return lean_pass.run(x, cos, sin_signed, mask if masked else None, self.norms, self.biases, keys,
                                 values, start, kv_len, self.nq, self.nk, self.d, self.eps, self.scaling, write,
                                 self._own_weights())
        folded = None if not masked else mask if q == 1 else fold_mask(mask, self.nq[0] // self.nk[0])
        own = self._own_weights() if self._takes_own(b, q) else None
        return native_pass.run_draft(x, cos, sin, folded, self.norms, self.packs, self.biases, self.reduce_range,
                                     keys, values, start, self.nq, self.nk, self.d, self.eps, kv_len, write, real,
                                     (b, q) if real is not None else (0, 0), own)

    def _takes_own(self, b: int, q: int) -> bool:
        """Whether this pass takes starjar's own int8 product: overridden while measured, forced, or chosen."""
        if self.own_override is not None:
            return self.own_override
        force = own_forced()
        if force is not None:
            return force
        return bool(self.own_chosen and self.own_chosen[pass_class(b, q)])

    def _takes_whole(self, b: int, q: int) -> bool:
        """Whether this pass runs the whole lean pass over the own int8 weights: overridden while measured,
        forced (STARJAR_LEAN_PASS), or chosen."""
        if self.whole_override is not None:
            return self.whole_override
        force = lean_pass.forced()
        if force is not None:
            return force and self._own_weights() is not None
        return b * q <= WHOLE_MAX_ROWS and bool(self.whole_chosen and self.whole_chosen[pass_class(b, q)])

    def _own_weights(self) -> tuple[list, list] | None:
        """The products' weights laid out for the own int8 product (once), or None where it cannot run."""
        if self._own is None and few_rows.int8_available():
            laid = [few_rows.int8_layout(p) for p in self.packs]
            if all(w is not None for w in laid):
                self._own = (huge_pages.gather([w for w, _ in laid]), [m for _, m in laid])  # streamed each step
                few_rows.settle_int8_stream(list(zip(*self._own, strict=True)))
        if self._own is None and own_forced():
            raise RuntimeError(f"{OWN_ENV}=own, but the own int8 product cannot run here "
                               "(it needs AVX-512 VNNI or AVX2)")
        return self._own

    def _own_measured(self, probe: Probe) -> dict[str, bool]:
        entry = kernels.cached_entry(f"{OWN_KIND}-{len(self.nq)}-layers", self.shapes,
                                     lambda: self._two_ways(probe, "own_override", "own", "torch"),
                                     usable=lambda e: isinstance(e.get("own"), dict) and set(e["own"]) == set(PROBES)
                                     and self._timed_every_class(e))
        return {k: bool(v) for k, v in entry["own"].items()}

    def _whole_measured(self, probe: Probe) -> dict[str, bool]:
        entry = kernels.cached_entry(f"{WHOLE_KIND}-{len(self.nq)}-layers", self.shapes,
                                     lambda: self._two_ways(probe, "whole_override", "whole", "native"),
                                     usable=lambda e: isinstance(e.get("whole"), dict) and
                                     set(e["whole"]) == set(PROBES) and self._timed_every_class(e))
        return {k: bool(v) for k, v in entry["whole"].items()}

    def _timed_every_class(self, entry: dict) -> bool:
        """Whether a cached choice was timed for every class this draft may run natively. A draft whose several-row
        passes cannot run natively caches those classes off untimed, under the same key as one whose can: read
        by the latter, its catch-up passes fell to the op-by-op kernels (2-5 tokens at 2 threads: 14-15 ms
        against 6.2 ms for one token, on a 2-core AMD EPYC, AVX-512)."""
        return not self.spans or set(entry.get("ms", {})) == set(PROBES)

    def _two_ways(self, probe: Probe, attr: str, on_name: str, off_name: str, reps: int = 7) -> dict:
        """Each probe pass natively with the override `attr` off and on, in turns; on where faster."""
        ms, on = {}, {}
        for cls, (b, q) in PROBES.items():
            if b * q > 1 and not self.spans:
                on[cls] = False
                continue
            times = []
            for way in (False, True):
                run = probe(b, q, True)

                def timed(run=run, way=way):
                    setattr(self, attr, way)
                    try:
                        return run()
                    finally:
                        setattr(self, attr, None)
                times.append(timed)
            off_s, on_s = kernels.interleaved_medians(times, reps)
            ms[cls] = {off_name: round(off_s * 1000, 3), on_name: round(on_s * 1000, 3)}
            on[cls] = on_s < off_s
        log.info("%s draft passes (%s): %s (measured: %s ms)", on_name, kernels.machine_label(), on, ms)
        return {on_name: on, "ms": ms}

    def _measured(self, probe: Probe) -> dict[str, bool]:
        entry = kernels.cached_entry(f"{KIND}-{len(self.nq)}-layers", self.shapes, lambda: self._measure(probe),
                                     usable=lambda e: isinstance(e.get("native"), dict) and
                                     set(e["native"]) == set(PROBES) and self._timed_every_class(e))
        return {k: bool(v) for k, v in entry["native"].items()}

    def _measure(self, probe: Probe, reps: int = 7) -> dict:
        """Each probe pass after CONTEXT positions, scripted and native in turns; native where faster."""
        ms, native = {}, {}
        for cls, (b, q) in PROBES.items():
            if b * q > 1 and not self.spans:
                native[cls] = False
                continue
            scripted_s, native_s = kernels.interleaved_medians([probe(b, q, False), probe(b, q, True)], reps)
            ms[cls] = {"scripted": round(scripted_s * 1000, 3), "native": round(native_s * 1000, 3)}
            native[cls] = native_s < scripted_s
        log.info("native draft passes (%s): %s (measured: %s ms)", kernels.machine_label(), native, ms)
        return {"native": native, "ms": ms}


def own_forced() -> bool | None:
    """What STARJAR_DRAFT_INT8 forces: True (own), False (torch's kernel), None (measured)."""
    name = kernels.forced_choice(OWN_ENV, ("own", "torch"))
    return None if name is None else name == "own"


def pass_class(b: int, q: int) -> str:
    """The PROBES class whose measurement decides a pass of b rows x q tokens."""
    return "step" if b * q == 1 else "span" if b == 1 else "rows"
