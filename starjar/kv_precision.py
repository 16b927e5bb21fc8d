"""The precision of an int8 draft's KV cache: float32 or float16, chosen by measurement on this machine.

A decode pass reads every cached key and value once. At batch 1 and a short context that is a small share of
a draft step, but it grows with rows x context: at 8 rows x 400 keys the default pair's draft reads 147 MB of
float32 K/V a pass, more than its 115 MB of int8 weights. Half precision halves those reads and the draft's KV
memory (a draft server fits twice the tokens in the same budget). Measured over 30 layers of one-query-per-row
attention (Intel Xeon, AVX512 capability, 2 threads): 8 x 400 keys 11.3 -> 6.8 ms, 16 x 300 17.7 -> 12.1 ms;
1 x 150 0.79 -> 0.91 ms (about 1% of a batch-1 draft step). Held to AVX2 the same shapes gave 12.1 -> 7.3,
19.4 -> 12.6 and 0.71 -> 0.93 ms.

Whether the half-precision kernel wins is the machine's: it is timed once per machine (starjar.kernels' cache)
at PROBE, a busy draft server's pass, and float16 is kept only when clearly faster. The draft only proposes:
what it attends in float16 can change a proposal, never the output, which verification keeps the target's.
`kv_dtype` in a draft's starjar.json, or STARJAR_DRAFT_KV, forces one (`auto` measures).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from starjar.errors import InvalidArgument
from starjar.kernels import cached_entry, forced_choice, interleaved_medians, machine_label

log = logging.getLogger(__name__)

KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}
ENV = "STARJAR_DRAFT_KV"
KIND = "draft-kv"
PROBE = (8, 512)  # rows x keys of the timed pass
CLEAR_WIN = 0.95  # float16 is kept when it takes at most this share of float32's time


def recipe_choice(value, what: str, where: str) -> str | None:
    """A recipe's kv_dtype, checked: a name in KV_DTYPES, or None for auto (unset or "auto")."""
    if value is None or value == "auto":
        return None
    if not isinstance(value, str) or value not in KV_DTYPES:
        raise InvalidArgument(what, f"kv_dtype in starjar.json must be auto or one of {sorted(KV_DTYPES)}",
                              f"{where}: {value!r}")
    return value


def draft_kv_dtype(recipe_value: str | None, layers: int, kv_heads: int, q_heads: int, head_dim: int) -> torch.dtype:
    """The KV dtype for an int8 draft of this shape: forced by STARJAR_DRAFT_KV, else the recipe's, else the
    one measured faster here (cached per machine and shape)."""
    name = forced_choice(ENV, tuple(KV_DTYPES)) or recipe_value
    if name is None:
        entry = cached_entry(KIND, ((layers, kv_heads), (q_heads, head_dim)),
                             lambda: _measure(layers, kv_heads, q_heads, head_dim),
                             usable=lambda e: e.get("kv_dtype") in KV_DTYPES)
        name = entry["kv_dtype"]
    return KV_DTYPES[name]


def _measure(layers: int, kv_heads: int, q_heads: int, head_dim: int) -> dict:
    ms = time_attention(layers, kv_heads, q_heads, head_dim)
    name = "float16" if ms["float16"] <= CLEAR_WIN * ms["float32"] else "float32"
    log.info("draft KV cache in %s (attention at %d rows x %d keys: %s; %s)", name, *PROBE,
             ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), machine_label())
    return {"kv_dtype": name, "ms": {k: round(v, 3) for k, v in ms.items()}, "probe_rows_keys": list(PROBE)}


def time_attention(layers: int, kv_heads: int, q_heads: int, head_dim: int, rows: int = PROBE[0],
                   keys: int = PROBE[1], reps: int = 5) -> dict[str, float]:
    """Median ms of one decode pass's attention in each KV dtype: `layers` layers of their own K/V (read from
    memory, as in a pass), one query per row, the query cast to the KV dtype and the output back."""
    torch.manual_seed(0)
    g = max(1, q_heads // kv_heads)
    q = torch.randn(rows, kv_heads, g, head_dim)
    runs = []
    for dtype in KV_DTYPES.values():
        kv = [(torch.randn(rows, kv_heads, keys, head_dim).to(dtype), torch.randn(rows, kv_heads, keys, head_dim)
               .to(dtype)) for _ in range(layers)]
        mask = torch.zeros(rows, 1, 1, keys, dtype=dtype)

        def attend(kv=kv, mask=mask, dtype=dtype):
            for k, v in kv:
                F.scaled_dot_product_attention(q.to(dtype), k, v, attn_mask=mask).float()
        runs.append(attend)
    return {name: 1000 * s for name, s in zip(KV_DTYPES, interleaved_medians(runs, reps), strict=True)}
