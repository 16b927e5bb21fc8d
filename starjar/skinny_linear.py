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

So the path is chosen per row bucket (BUCKETS), separately for the layers of the model's body and for its
output layer (a vocabulary-wide product is another shape), by timing the model's own passes once per machine
(`starjar.kernels.cached_entry`, a few seconds for the default target); STARJAR_FP32_LINEAR=linear|wxt
forces one path for every bucket (tests force each). One row always keeps F.linear's GEMV.

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

from starjar import kernels

log = logging.getLogger(__name__)

PATHS = ("linear", "wxt")
KIND = "fp32-rows"  # its entries in the kernel cache
ENV = "STARJAR_FP32_LINEAR"
BUCKETS = (2, 4, 8, 16, 32, 64)  # rows up to each; more than 64 rows take the last bucket's path
WIDE = 8192  # output features from which a layer counts as an output layer (a vocabulary-wide product)
DEFAULT = "wxt"  # before a measurement: what the first machine measured
NOISE = 0.10  # the other path must be this much faster to replace DEFAULT in a bucket


class RowPaths:
    """The path of each row bucket, for the body's layers and for the output layer. Shared by every layer of
    one model; changing it changes what the model's next pass runs."""

    def __init__(self, body: list[str] | None = None, head: list[str] | None = None):
        self.body = list(body or [DEFAULT] * len(BUCKETS))
        self.head = list(head or [DEFAULT] * len(BUCKETS))
        for paths in (self.body, self.head):
            if len(paths) != len(BUCKETS) or any(p not in PATHS for p in paths):
                raise ValueError(f"row paths must name one of {PATHS} for each of {len(BUCKETS)} buckets: {paths}")

    @classmethod
    def every(cls, path: str) -> RowPaths:
        return cls([path] * len(BUCKETS), [path] * len(BUCKETS))

    def as_dict(self) -> dict:
        return {"buckets": list(BUCKETS), "body": list(self.body), "head": list(self.head)}

    @classmethod
    def from_dict(cls, d: dict) -> RowPaths:
        if list(d.get("buckets", ())) != list(BUCKETS):
            raise ValueError("row paths were measured for other buckets")
        return cls(d["body"], d["head"])

    def set(self, other: RowPaths) -> None:
        self.body[:], self.head[:] = other.body, other.head


def forced() -> str | None:
    """The path named by STARJAR_FP32_LINEAR, or None for measurement (auto)."""
    return kernels.forced_choice(ENV, PATHS)


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
        return F.linear(x, w, self.bias)
    paths = self._starjar_row_paths.head if self._starjar_wide else self._starjar_row_paths.body
    if paths[_bucket(rows)] == "linear":
        return F.linear(x, w, self.bias)
    out = torch.matmul(w, x.reshape(rows, k).t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], w.shape[0])


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


def measure(model: torch.nn.Module, reps: int = 3) -> dict:
    """Time both paths on `model` (installed) for every row bucket: the body by passes of its decoder over
    that many positions (weights as cold as in a real pass), the output layer alone. Returns
    {"paths": RowPaths.as_dict(), "ms": ...}; the model keeps the winners."""
    shared = installed(model)
    if shared is None:
        raise ValueError("install() the few-rows paths before measuring them")
    heads = [m for m in model.modules() if type(m) is torch.nn.Linear and m.out_features >= WIDE]
    param = next(model.parameters())
    body_only = getattr(model, "base_model", model)  # a causal LM's decoder without its output layer
    ms: dict[str, list] = {"body": [], "head": []}
    with torch.inference_mode():
        for i, rows in enumerate(BUCKETS):
            ids = torch.full((1, rows), 7, dtype=torch.long, device=param.device)
            ms["body"].append(_time_bucket(shared.body, i,
                                           lambda ids=ids: body_only(input_ids=ids, use_cache=False), reps))
            if heads:
                x = torch.randn(rows, heads[0].in_features, device=param.device)
                ms["head"].append(_time_bucket(shared.head, i, lambda x=x: heads[0](x), reps))
            else:
                shared.head[i] = DEFAULT
    log.info("fp32 linear paths for 2..%d rows (%s): body %s, output layer %s (measured: %s ms)", BUCKETS[-1],
             kernels.machine_label(), "/".join(shared.body), "/".join(shared.head), ms)
    return {"paths": shared.as_dict(), "ms": ms}


def choose(model: torch.nn.Module) -> RowPaths | None:
    """Give an installed model this machine's paths for its shapes: forced, cached, or measured now (once per
    machine, thread count and set of shapes)."""
    shared = installed(model)
    if shared is None or forced():
        return shared
    entry = kernels.cached_entry(KIND, shapes(model), lambda: measure(model), usable=_usable)
    shared.set(RowPaths.from_dict(entry["paths"]))
    return shared


def _usable(entry: dict) -> bool:
    """An entry of another layout (other buckets, a damaged file) is measured again and replaced."""
    try:
        RowPaths.from_dict(entry["paths"])
        return True
    except (KeyError, TypeError, ValueError):
        return False


def _time_bucket(slots: list[str], i: int, run: Callable[[], object], reps: int) -> list[float]:
    """Time `run` with bucket i of `slots` on each path, in turns; the bucket keeps the faster. Returns ms."""
    def on(path: str) -> Callable[[], object]:
        def timed():
            slots[i] = path
            return run()
        return timed
    times = kernels.interleaved_medians([on(p) for p in PATHS], reps)
    slots[i] = _faster(times)
    return [round(t * 1000, 3) for t in times]


def _faster(times: list[float]) -> str:
    """The faster path, but DEFAULT unless the other wins by more than NOISE (a close call is noise)."""
    best = PATHS[times.index(min(times))]
    return best if times[PATHS.index(DEFAULT)] > (1 + NOISE) * min(times) else DEFAULT
