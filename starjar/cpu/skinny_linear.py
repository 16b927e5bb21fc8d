"""Which product a CPU fp32 linear layer runs for a few rows, chosen by measurement on this machine.

Verification (gamma+1 rows per sequence), batched decoding and batched drafting apply every linear layer of
the target to a few rows. Two spellings of the same product take different BLAS paths, and which one is fast
depends on the CPU:
  linear  `F.linear(x, W)` (x @ W.T);
  wxt     `W @ x.T`, transposed back.
On a 2-core AVX2 AMD EPYC (MKL sgemm), the default target's 49k-wide output layer took 11.0 ms for 2 rows
with F.linear and 2.1 ms as W @ x.T, and W @ x.T was never slower from 2 to 256 rows: a verification pass over
2 / 5 tokens dropped from 53 / 54 ms to 30 / 40 ms. On a 2-core Intel Xeon with AVX-512 and AMX the same
choice is a cliff the other way: a pass over 2 positions took 67.8 ms as W @ x.T and 31.3 ms with F.linear,
one over 4 positions 69.0 against 48.0 ms, so a verification of any gamma cost 2.15 single-token steps.

A third spelling, where torch has MKL:
  packed  MKL's sgemm on weights packed once (`torch.ops.mkl._mkl_linear`, what inductor runs for fp32 CPU
          linears). From 4 rows on, MKL's sgemm repacks the whole weight on every call; on that Xeon a pass
          of the default target's layers over 4 rows took 24.5 ms against 18.1 ms over 3 (the weights
          stream from memory: 15.6 ms for one row), and 19.6 ms packed. Its results from 4 rows on were
          bit-equal to F.linear's there. It costs a second copy of every weight it packs, so it is only
          measured when that copy fits in half the memory available, and only wins a bucket by PACKED_MARGIN.

A fourth, where starjar's own product builds (starjar.cpu.few_rows):
  rows    each tile of weight rows loaded once against every input row. On that Xeon MKL's products read the
          weights more than once between 4 and 12 rows (the output layer over 12 rows: 19.9 ms with F.linear,
          10.7 as W @ x.T, 8.3 here; one row 4.0); the body's layers over 8 rows took 41 ms with F.linear and
          30 here.

So the path is chosen per row bucket (BUCKETS), separately for the layers of the model's body and for its
output layer (a vocabulary-wide product is another shape), by timing the model's own passes once per machine
(`starjar.cpu.kernels.cached_entry`, a few seconds for the default target); STARJAR_FP32_LINEAR=linear|wxt|packed
forces one path for every bucket (tests force each). One row always keeps F.linear's GEMV. A bucket is
timed at its top and its middle (MKL changes its method inside the 9-16 bucket: 12 rows took twice 16's).

The function computed is the same; only floating-point summation order can differ, as it does between any two
batch sizes. The paths are installed on the model instance, so everything that runs that model (starjar's
engines and HF `generate()` alike) uses the same kernels for the same shapes.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from starjar.cpu import few_rows, kernels

log = logging.getLogger(__name__)

PATHS = ("linear", "wxt", "packed", "rows")
PACKED = "packed"  # the path that keeps a second copy of the weights
OWN = "rows"  # starjar's own product (starjar.cpu.few_rows)
KIND = "fp32-rows"  # its entries in the kernel cache
ENV = "STARJAR_FP32_LINEAR"
# Rows up to each; more than 64 rows take the last bucket's path. 3 and 4 apart: MKL's sgemm changes its
# method between them (gamma 2 verifies 3 positions, gamma 3 four).
BUCKETS = (2, 3, 4, 6, 8, 16, 32, 64)
# One row: the body keeps F.linear's GEMV; the output layer takes it or the own product, as measured (on a
# 2-core AMD EPYC, AVX2, MKL's GEMV read the default target's output layer at 11 GB/s, half the bandwidth).
ONE_ROW = ("linear", OWN)
PACK_HINT = 8  # the row count MKL packs for; its packed layout served 4 to 64 rows alike on the Xeon
WIDE = 8192  # output features from which a layer counts as an output layer (a vocabulary-wide product)
DEFAULT = "wxt"  # before a measurement: what the first machine measured
NOISE = 0.10  # the other path must be this much faster to replace DEFAULT in a bucket
PACKED_MARGIN = 0.05  # packed must be this much faster than the plain choice (its copy costs memory)


class RowPaths:
    """The path of each row bucket, for the body's layers and for the output layer. Shared by every layer of
    one model; changing it changes what the model's next pass runs."""

    def __init__(self, body: list[str] | None = None, head: list[str] | None = None, head_one: str = "linear"):
        self.body = list(body or [DEFAULT] * len(BUCKETS))
        self.head = list(head or [DEFAULT] * len(BUCKETS))
        for paths in (self.body, self.head):
            if len(paths) != len(BUCKETS) or any(p not in PATHS for p in paths):
                raise ValueError(f"row paths must name one of {PATHS} for each of {len(BUCKETS)} buckets: {paths}")
        if head_one not in ONE_ROW:
            raise ValueError(f"the output layer's one-row path must be one of {ONE_ROW}: {head_one}")
        self.head_one = head_one

    @classmethod
    def every(cls, path: str) -> RowPaths:
        return cls([path] * len(BUCKETS), [path] * len(BUCKETS), path if path in ONE_ROW else "linear")

    def as_dict(self) -> dict:
        return {"buckets": list(BUCKETS), "body": list(self.body), "head": list(self.head),
                "head_one": self.head_one}

    @classmethod
    def from_dict(cls, d: dict) -> RowPaths:
        if list(d.get("buckets", ())) != list(BUCKETS):
            raise ValueError("row paths were measured for other buckets")
        return cls(d["body"], d["head"], d.get("head_one", "linear"))

    def set(self, other: RowPaths) -> None:
        self.body[:], self.head[:] = other.body, other.head
        self.head_one = other.head_one


def forced() -> str | None:
    """The path named by STARJAR_FP32_LINEAR, or None for measurement (auto)."""
    name = kernels.forced_choice(ENV, PATHS)
    if name == PACKED and not packing_available():
        raise ValueError(f"{ENV}={PACKED} needs torch built with MKL (this torch has none)")
    if name == OWN and not few_rows.available():
        raise ValueError(f"{ENV}={OWN} needs starjar's few-rows product, which could not be built here")
    return name


def packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def _packing_fits(model: torch.nn.Module) -> bool:
    """Whether a packed copy of every fp32 linear weight fits in half the memory available now."""
    need = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True  # no /proc: nothing says it does not fit
    return need <= avail // 2


def bucket_index(rows: int) -> int:
    """The index in BUCKETS of the bucket a pass over `rows` rows falls in (the last for more)."""
    return _bucket(rows)


def _bucket(rows: int) -> int:
    for i, top in enumerate(BUCKETS):
        if rows <= top:
            return i
    return len(BUCKETS) - 1


def _few_rows_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32:
        return F.linear(x, w, self.bias)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows < 2:
        if self._starjar_wide and self._starjar_row_paths.head_one == OWN:
            return few_rows.product(x.reshape(rows, k), w, self.bias).reshape(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, self.bias)
    paths = self._starjar_row_paths.head if self._starjar_wide else self._starjar_row_paths.body
    path = paths[_bucket(rows)]
    if path == "linear":
        return F.linear(x, w, self.bias)
    if path == OWN:
        return few_rows.product(x.reshape(rows, k), w, self.bias).reshape(*x.shape[:-1], w.shape[0])
    if path == PACKED and not (w.requires_grad and torch.is_grad_enabled()):  # MKL's packed op has no backward
        return _packed_product(self, x.reshape(rows, k).contiguous()).reshape(*x.shape[:-1], w.shape[0])
    out = torch.matmul(w, x.reshape(rows, k).t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], w.shape[0])


def bucket_paths(model: torch.nn.Module, rows: int) -> tuple[str, str]:
    """The paths an installed model's linears take for a pass over `rows` rows in float32 on the CPU (what
    _few_rows_forward picks): (the body's, the output-sized layers'); F.linear's for one row or no paths."""
    shared = installed(model)
    if shared is None or rows < 2:
        return "linear", "linear"
    return shared.body[_bucket(rows)], shared.head[_bucket(rows)]


def is_wide(layer: torch.nn.Linear) -> bool:
    """Whether an installed layer takes the output layer's paths (a vocabulary-wide product)."""
    return bool(getattr(layer, "_starjar_wide", False))


def packed_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """The layer's weight as MKL packs it for the packed path (packed now if it is not yet)."""
    return _packed(layer)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] as MKL packs it for the packed path (a second copy)."""
    with torch.no_grad():
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_HINT)


def drop_packed(layer: torch.nn.Linear) -> None:
    """Free the layer's packed copy (packed again on its next packed product)."""
    layer.__dict__.pop("_starjar_packed", None)


def _packed_product(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] through MKL's sgemm on the layer's packed weight."""
    return torch.ops.mkl._mkl_linear(x, _packed(layer), layer.weight, layer.bias, x.shape[0])


class _Packed:
    """A layer's packed weight and the version of the weight it was packed from. MKL's packed tensor has no
    storage to copy, so a copied (or pickled) model gets an empty one and packs again on first use."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.stamp: tuple | None = None

    def __deepcopy__(self, memo) -> _Packed:
        return _Packed()

    def __getstate__(self) -> dict:
        return {"tensor": None, "stamp": None}


def _packed(layer: torch.nn.Linear) -> torch.Tensor:
    """The layer's weight as MKL packs it, packed on first use and again if the weight was written since."""
    w = layer.weight
    stamp = (w.data_ptr(), w._version)
    held = layer.__dict__.setdefault("_starjar_packed", _Packed())
    if held.stamp != stamp:
        held.tensor = pack(w)
        held.stamp = stamp
    return held.tensor


def _settle_packing(model: torch.nn.Module) -> None:
    """Pack now the layers whose path is packed for some bucket (the first request does not pay for it), and
    free the copies of those whose path is not."""
    paths = installed(model)
    for m in model.modules():
        if type(m) is not torch.nn.Linear or not hasattr(m, "_starjar_row_paths"):
            continue
        if PACKED in (paths.head if m._starjar_wide else paths.body):
            _packed(m)
        else:
            m.__dict__.pop("_starjar_packed", None)


def install(model: torch.nn.Module, paths: RowPaths | None = None) -> int:
    """Route every nn.Linear of `model` through the few-rows paths (shared, kept on the model); returns how
    many layers. Before `measure` sets them, every bucket takes the forced path or DEFAULT."""
    shared = paths or (RowPaths.every(forced()) if forced() else RowPaths())
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module._starjar_row_paths = shared
            module._starjar_wide = module.out_features >= WIDE
            module.forward = types.MethodType(_few_rows_forward, module)
            n += 1
    model._starjar_row_paths = shared
    return n


def installed(model: torch.nn.Module) -> RowPaths | None:
    return getattr(model, "_starjar_row_paths", None)


def shapes(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """The (in, out) shapes of the model's linear layers: what a measurement holds for."""
    return tuple(sorted({(m.in_features, m.out_features) for m in model.modules() if type(m) is torch.nn.Linear}))


def measure(model: torch.nn.Module, reps: int = 5) -> dict:
    """Time every path this machine has on `model` (installed) for every row bucket: the body by passes of its
    decoder over that many positions (weights as cold as in a real pass), the output layer alone. Returns
    {"paths": RowPaths.as_dict(), "ms": {"body": [{path: ms}, ...], "head": [...]}}; the model keeps the
    winners (choose() then packs or frees its weights)."""
    shared = installed(model)
    if shared is None:
        raise ValueError("install() the few-rows paths before measuring them")
    timed = candidate_paths(model)
    heads = [m for m in model.modules() if type(m) is torch.nn.Linear and m.out_features >= WIDE]
    param = next(model.parameters())
    body_only = getattr(model, "base_model", model)  # a causal LM's decoder without its output layer
    ms: dict[str, list] = {"body": [], "head": []}
    with torch.inference_mode():
        for i in range(len(BUCKETS)):
            ids = [torch.full((1, rows), 7, dtype=torch.long, device=param.device) for rows in timed_rows(i)]
            ms["body"].append(_time_bucket(shared.body, i, timed, lambda ids=ids: [
                body_only(input_ids=one, use_cache=False) for one in ids], reps))
            if heads:
                xs = [torch.randn(rows, heads[0].in_features, device=param.device) for rows in timed_rows(i)]
                ms["head"].append(_time_bucket(shared.head, i, timed, lambda xs=xs: [heads[0](x) for x in xs],
                                               reps))
            else:
                shared.head[i] = DEFAULT
        if heads and OWN in timed:
            x = torch.randn(1, heads[0].in_features, device=param.device)
            ms["head_one"] = _time_one_row(shared, lambda: heads[0](x), reps)
    log.info("fp32 linear paths for 2..%d rows (%s): body %s, output layer %s (measured: %s ms)", BUCKETS[-1],
             kernels.machine_label(), "/".join(shared.body), "/".join(shared.head), ms)
    return {"paths": shared.as_dict(), "ms": ms}


def timed_rows(i: int) -> tuple[int, ...]:
    """The row counts bucket i is timed at: its top and, where the bucket holds more than two, its middle."""
    low, top = (BUCKETS[i - 1] + 1 if i else 2), BUCKETS[i]
    return (top,) if top - low < 2 else ((low + top) // 2, top)


def candidate_paths(model: torch.nn.Module) -> tuple[str, ...]:
    """The paths worth timing here: packed only with MKL and room for a second copy of the weights, rows
    where starjar's own product builds."""
    drop = set() if packing_available() and _packing_fits(model) else {PACKED}
    if not few_rows.available():
        drop.add(OWN)
    return tuple(p for p in PATHS if p not in drop)


def choose(model: torch.nn.Module) -> RowPaths | None:
    """Give an installed model this machine's paths for its shapes: forced, cached, or measured now (once per
    machine, thread count and set of shapes)."""
    shared = installed(model)
    if shared is None or forced():
        return shared
    entry = kernels.cached_entry(KIND, shapes(model), lambda: measure(model),
                                 usable=lambda e: _usable(e, candidate_paths(model)))
    shared.set(RowPaths.from_dict(entry["paths"]))
    _settle_packing(model)
    return shared


def _usable(entry: dict, allowed: tuple[str, ...] = PATHS) -> bool:
    """An entry of another layout (other buckets, a damaged file), one that packs where packing no longer
    fits, or one that did not time every path this machine has now, is measured again and replaced."""
    try:
        paths = RowPaths.from_dict(entry["paths"])
        timed = set(entry["ms"]["body"][0])
    except (KeyError, TypeError, ValueError, IndexError):
        return False
    one_timed = OWN not in allowed or "head_one" in entry["paths"]
    return all(p in allowed for p in paths.body + paths.head) and set(allowed) <= timed and one_timed


def _time_one_row(shared: RowPaths, run: Callable[[], object], reps: int) -> dict[str, float]:
    """Time the output layer over one row on each ONE_ROW path, in turns; the faster is kept (F.linear unless
    the other wins by NOISE). Returns ms by path."""
    def on(path: str) -> Callable[[], object]:
        def timed_run():
            shared.head_one = path
            return run()
        return timed_run
    times = dict(zip(ONE_ROW, kernels.interleaved_medians([on(p) for p in ONE_ROW], reps), strict=True))
    shared.head_one = OWN if times[OWN] < times["linear"] * (1 - NOISE) else "linear"
    return {p: round(t * 1000, 3) for p, t in times.items()}


def _time_bucket(slots: list[str], i: int, timed: tuple[str, ...], run: Callable[[], object],
                 reps: int) -> dict[str, float]:
    """Time `run` with bucket i of `slots` on each path in `timed`, in turns; the bucket keeps the faster.
    Returns ms by path."""
    def on(path: str) -> Callable[[], object]:
        def timed_run():
            slots[i] = path
            return run()
        return timed_run
    times = dict(zip(timed, kernels.interleaved_medians([on(p) for p in timed], reps), strict=True))
    slots[i] = _faster(times)
    return {p: round(t * 1000, 3) for p, t in times.items()}


def _faster(times: dict[str, float]) -> str:
    """The faster path, but DEFAULT unless another wins by more than NOISE (a close call is noise), and packed
    (a second copy of the weights) only if it beats that choice by more than PACKED_MARGIN."""
    plain = {p: t for p, t in times.items() if p != PACKED}
    best = min(plain, key=plain.get)
    choice = best if plain[DEFAULT] > (1 + NOISE) * plain[best] else DEFAULT
    if PACKED in times and plain[choice] > (1 + PACKED_MARGIN) * times[PACKED]:
        return PACKED
    return choice
