"""The lean target's choices, each measured once per machine and model shapes on the model's own passes and kept
in starjar.cpu.kernels' cache: which pass classes run lean at all (KIND), which row buckets take the fused
projections (FUSED_KIND), which classes run the native pass (NATIVE_KIND) and which the whole lean pass
(WHOLE_KIND, starjar.model.lean_pass). Each is measured with the choices before it in force, so the last one
times the passes as they would run.
"""

from __future__ import annotations

import logging

import torch

from starjar.cpu import kernels, skinny_linear
from starjar.model.kv_cache import RaggedKVCache

log = logging.getLogger(__name__)

KIND = "lean-target"  # its entries in the kernel cache
# The entries of the fused-or-apart choice per row bucket ("-native": fused passes timed as they run, natively
# where that was chosen; apart ones never are, so timing both scripted had kept 12-row passes off the native
# pass: 86-88 ms apart against 76-78 ms fused and native, default target on the 2-core Xeon).
FUSED_KIND = "fused-rows-native"
NATIVE_KIND = "native-pass"  # the entries of the native-or-scripted choice (one-row steps, other passes)
WHOLE_KIND = "lean-pass"  # the entries of the whole-pass choice (one-row steps, other passes up to LONG rows)
CLASSES = ("step", "rows", "long")
PROBES = {"step": (1, 1), "rows": (2, 4), "long": (1, 128)}  # the (B, Q) each class is timed at
CONTEXT = 64  # cached tokens per row before a timed pass
# The whole pass's own classes: past WIDE_FROM rows (up to lean_target.LONG) a pass is "wide", timed at WIDE_PROBE.
WHOLE_CLASSES = ("step", "rows", "wide")
WIDE_FROM = 16
WIDE_PROBE = (1, 48)


def _dtype(lt) -> str:
    return str(next(lt.model.parameters()).dtype).removeprefix("torch.")


def lean_classes(lt) -> dict[str, bool]:
    """Per shape class, whether the lean forward runs it: both forwards timed in turns on a pass of each class
    (PROBES) over CONTEXT cached tokens per row; a class runs lean where that was faster."""
    def measure(reps: int = 5) -> dict:
        ms, lean = {}, {}
        for cls, (b, q) in PROBES.items():
            eager_s, lean_s = kernels.interleaved_medians([probe(lt, b, q, False), probe(lt, b, q, True)],
                                                          reps if cls != "long" else max(2, reps // 2))
            ms[cls] = {"eager": round(eager_s * 1000, 3), "lean": round(lean_s * 1000, 3)}
            lean[cls] = lean_s < eager_s
        lt._drop_module_packs()
        log.info("lean target forward per pass class (%s): %s (measured: %s ms)", kernels.machine_label(),
                 ", ".join(f"{c} {'lean' if on else 'HF'}" for c, on in lean.items()), ms)
        return {"lean": lean, "ms": ms}

    entry = kernels.cached_entry(f"{KIND}-{_dtype(lt)}", skinny_linear.shapes(lt.model), measure,
                                 usable=lambda e: isinstance(e.get("lean"), dict) and set(e["lean"]) == set(CLASSES))
    return {c: bool(entry["lean"][c]) for c in CLASSES}


def fused_buckets(lt) -> list[bool]:
    """Per skinny_linear row bucket, whether passes take the fused products: the lean forward timed with the
    projections apart and fused, in turns, on one row of as many tokens as the bucket holds, each as it would
    run (fused passes natively where that is chosen); fused where it was not slower."""
    def measure(reps: int = 3) -> dict:
        ms, fused = [], []
        for rows in skinny_linear.BUCKETS:
            apart_s, fused_s = kernels.interleaved_medians([probe(lt, 1, rows, True, False, native=False),
                                                            probe(lt, 1, rows, True, True)], reps)
            ms.append({"apart": round(apart_s * 1000, 3), "fused": round(fused_s * 1000, 3)})
            fused.append(fused_s <= apart_s)
        lt._drop_module_packs()
        log.info("fused projections per row bucket %s (%s): %s (measured: %s ms)", skinny_linear.BUCKETS,
                 kernels.machine_label(), fused, ms)
        return {"fused": fused, "buckets": list(skinny_linear.BUCKETS), "ms": ms}

    n = len(skinny_linear.BUCKETS)
    entry = kernels.cached_entry(f"{FUSED_KIND}-{_dtype(lt)}", skinny_linear.shapes(lt.model), measure,
                                 usable=lambda e: isinstance(e.get("fused"), list) and len(e["fused"]) == n)
    return [bool(f) for f in entry["fused"]]


def native_classes(lt) -> dict[str, bool]:
    """Whether one-row steps and other chain passes run natively: a pass of each (PROBES) timed scripted and
    native, in turns."""
    return _two_ways(lt, NATIVE_KIND, "native", "scripted", lambda b, q, on: probe(lt, b, q, True, True, native=on))


def whole_classes(lt) -> dict[str, bool]:
    """Whether one-row steps, other chain passes up to WIDE_FROM rows and wider ones (short prompts' prefill)
    run the whole lean pass: a pass of each (PROBES, WIDE_PROBE) timed with it and as the other choices run it,
    in turns. (On the 2-core AVX2 EPYC its tiles took 268 ms over 64 rows against 178 the other way.)"""
    return _two_ways(lt, WHOLE_KIND, "whole", "other", lambda b, q, on: probe(lt, b, q, True, whole=on),
                     classes=WHOLE_CLASSES)


def _two_ways(lt, kind: str, name: str, other: str, make, reps: int = 5,
              classes: tuple[str, ...] = ("step", "rows")) -> dict[str, bool]:
    """A cached per-class choice between two ways of running the class probes: `name` where faster."""
    def measure() -> dict:
        ms, chosen = {}, {}
        for cls in classes:
            b, q = WIDE_PROBE if cls == "wide" else PROBES[cls]
            off_s, on_s = kernels.interleaved_medians([make(b, q, False), make(b, q, True)], reps)
            ms[cls] = {other: round(off_s * 1000, 3), name: round(on_s * 1000, 3)}
            chosen[cls] = on_s < off_s
        log.info("%s target passes (%s): %s (measured: %s ms)", name, kernels.machine_label(), chosen, ms)
        return {name: chosen, "ms": ms}

    entry = kernels.cached_entry(f"{kind}-float32", skinny_linear.shapes(lt.model), measure,
                                 usable=lambda e: isinstance(e.get(name), dict) and set(e[name]) == set(classes))
    return {k: bool(v) for k, v in entry[name].items()}


def probe(lt, b: int, q: int, lean: bool, fused: bool | None = None, native: bool | None = None,
          whole: bool | None = False):
    """A function running one pass of b rows x q tokens, lean or HF's, after CONTEXT tokens in its own cache;
    fused, native and whole force those choices for it (None: as chosen; the whole pass is off unless asked)."""
    param = next(lt.model.parameters())
    cache = RaggedKVCache(param.device, param.dtype)
    slots = [cache.allocate() for _ in range(b)]

    @torch.no_grad()
    def run(n: int) -> None:
        for s in slots:
            cache.truncate(s, min(cache.lengths[s], CONTEXT))
        pos, mask = cache.begin(slots, [n] * b)
        ids = torch.full((b, n), 7, dtype=torch.long, device=param.device)
        lt._fused_override, lt._native_override, lt._whole_override = fused, native, whole
        try:
            done = lean and lt.run(ids, pos, mask, cache) is not None
        finally:
            lt._fused_override = lt._native_override = lt._whole_override = None
        if not done:
            lt.base(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)

    run(CONTEXT)
    return lambda: run(q)
