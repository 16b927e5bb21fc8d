"""The precision of an int8 draft's KV cache: float32 (the default) or float16 (recipe key kv_dtype).

A decode pass reads every cached key and value once. At batch 1 and a short context that is a small share of
a draft step, but it grows with rows x context: at 8 rows x 400 keys the default pair's draft reads 147 MB of
float32 K/V a pass, more than its 115 MB of int8 weights. Half precision halves those reads and the draft's KV
memory (a draft server fits twice the tokens in the same budget). Measured on the default pair (Intel Xeon,
AVX512 capability, 2 threads; benchmarks/probes/measure_draft_kv.py), a gamma-4 draft round in float16 over float32:
1 x 128 tokens 1.00x, 1 x 1024 0.90x, 8 x 512 0.87x, 16 x 1024 0.79x. But the draft proposes worse from a
float16 cache (the int8 activations amplify its rounding): `bench core` at batch 1 went from 1.52x to 1.45x,
acceptance at gamma 5 0.80 -> 0.76, and batch 8 and 16 lost 3-7% at their short contexts. Most of that loss
is attention computed in float16: kept in float16 but attended in float32, acceptance was 0.79, and the
conversion cost what the smaller reads saved (0.998-1.026x at every shape above). So float32 stays
the default, and float16 is for drafts that serve long contexts or many sequences, where the reads (and the
memory) dominate. The draft only proposes: either way the output is the target's.
`kv_dtype` in a draft's starjar.json, or STARJAR_DRAFT_KV, chooses (the variable wins).
"""

from __future__ import annotations

import torch

from starjar.cpu.kernels import forced_choice
from starjar.errors import InvalidArgument

KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}
ENV = "STARJAR_DRAFT_KV"


def recipe_choice(value, what: str, where: str) -> str | None:
    """A recipe's kv_dtype, checked: a name in KV_DTYPES, or None when unset."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in KV_DTYPES:
        raise InvalidArgument(what, f"kv_dtype in starjar.json must be one of {sorted(KV_DTYPES)}",
                              f"{where}: {value!r}")
    return value


def draft_kv_dtype(recipe_value: str | None) -> torch.dtype:
    """The KV dtype of an int8 draft: forced by STARJAR_DRAFT_KV, else the recipe's, else float32."""
    return KV_DTYPES[forced_choice(ENV, tuple(KV_DTYPES)) or recipe_value or "float32"]
