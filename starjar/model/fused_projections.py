"""Each decoder layer's q, k and v weights in one tensor, and its gate and up weights in another.

A batch-1 target step reads every weight once; three GEMVs over q, k and v (and two over gate and up) pay
their dispatch and thread fork per product, one GEMV over the concatenation pays it once. The modules keep
working on their own weights: after fusing, each Linear's weight is a view of its rows of the concatenation
(no second copy), so Hugging Face's forward and every other pass read the same memory.

The fused products are only taken where they change no bit: products over the concatenation (one row and
several, by each path starjar.cpu.skinny_linear may take) must equal the separate products exactly (each
output is the same dot product, but a kernel may pick its blocking by the output width), checked on the
running machine on the layers' own weights. Where they differ (MKL's GEMV on a 2-core AMD EPYC, AVX2, for
the default target's q/k/v) the modules keep their own weights (a view there changed HF's bits too) and the
concatenations are copies that only the whole lean pass (starjar.model.lean_pass) reads, with its own products.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from starjar.cpu import huge_pages, skinny_linear

log = logging.getLogger(__name__)

ROWS = (1, 1, 2, 3, 4, 6, 8, 16, 32, 64, 65, 70, 128)  # row counts checked (random rows): each bucket, prefills


def _concat(linears: list[torch.nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """The linears' weights (and biases) stacked by output row: a view where they already lie back to back
    (starjar.cpu.huge_pages lays them so), else a copy."""
    return _stacked([lin.weight.detach() for lin in linears]), \
        None if linears[0].bias is None else _stacked([lin.bias.detach() for lin in linears])


def _stacked(parts: list[Tensor]) -> Tensor:
    whole = huge_pages.adjacent(parts)
    return whole if whole is not None else torch.cat(parts).contiguous()


def _products(x: Tensor, weight: Tensor, bias: Tensor | None) -> list[Tensor]:
    """x [rows, in] through every product the lean forward may take for rows (starjar.model.target_step)."""
    out = [F.linear(x, weight, bias)]
    if x.shape[0] > 1 and x.dtype == torch.float32:
        wxt = weight.matmul(x.t()).t()
        out.append(wxt if bias is None else wxt + bias)
        if skinny_linear.packing_available():
            out.append(torch.ops.mkl._mkl_linear(x, skinny_linear.pack(weight), weight, bias, x.shape[0]))
    return out


def _same_products(linears: list[torch.nn.Linear], weight: Tensor, bias: Tensor | None) -> bool:
    """Whether products over the concatenation equal the separate ones bit for bit here, for one row and for
    several (ROWS), by every path."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
            apart = [_products(x, lin.weight, lin.bias) for lin in linears]
            for i, whole in enumerate(_products(x, weight, bias)):
                if not torch.equal(torch.cat([p[i] for p in apart], dim=-1), whole):
                    return False
    return True


def _rebind(linears: list[torch.nn.Linear], weight: Tensor, bias: Tensor | None) -> None:
    """Each linear's weight (and bias) becomes the view of its rows of the concatenation."""
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = torch.nn.Parameter(weight.narrow(0, row, n), requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias.narrow(0, row, n), requires_grad=False)
        row += n


def fuse(layers) -> tuple[list[tuple[Tensor, Tensor | None, Tensor, Tensor | None]], bool] | None:
    """Per decoder layer: (qkv weight, qkv bias, gate-up weight, gate-up bias), and whether products over them
    give the separate products' bits here: if so the modules are rebound to views of them, if not they are
    copies and the modules are left as they are; None where a group mixes biased and unbiased linears."""
    groups = [grp for layer in layers for grp in ([layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                  layer.self_attn.v_proj], [layer.mlp.gate_proj, layer.mlp.up_proj])]
    if any(len({lin.bias is None for lin in lins}) != 1 for lins in groups):
        return None
    checked: set[tuple] = set()
    exact = True
    for lins in groups:
        shape = (tuple(lin.weight.shape for lin in lins), lins[0].bias is None, lins[0].weight.dtype)
        if exact and shape not in checked:  # the blocking a kernel picks depends on the shapes, not the values
            if not _same_products(lins, *_concat(lins)):
                log.info("fused products left out: one differs in the last bits here (%s)", shape)
                exact = False
            checked.add(shape)
    fused = []
    for lins in groups:  # one layer's concatenation at a time: the old weights go as their views come
        fused.append(_concat(lins))
        if not exact:
            continue
        _rebind(lins, *fused[-1])
        for lin in lins:
            skinny_linear.drop_packed(lin)  # packed from the old weights; the lean forward packs the whole
    return [(*fused[i], *fused[i + 1]) for i in range(0, len(fused), 2)], exact
