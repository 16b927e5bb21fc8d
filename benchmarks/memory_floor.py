"""How far the target's decoding is from the memory floor on this machine.

At batch 1 a decode step reads every weight once (a tied embedding and head once), so no engine decodes
faster than the machine's read bandwidth over those bytes. The bandwidth is probed here: the sum of a float32
array far larger than the caches, best of a few repeats, on the benchmark's threads. The target's decode rate
is one prompt's 64 new tokens at batch 1, gamma 0, prefill left out, the median of three runs.
"""

from __future__ import annotations

import statistics
import time

import torch

from controller.colocated import colocated_engine
from starjar.spec.sampling import SamplingParams

PROBE_BYTES = 512 << 20  # 512 MiB: past any last-level cache
PROBE_REPEATS = 5
DECODE_TOKENS = 64
DECODE_REPEATS = 3  # one run of the same code varied from 27 to 34 tokens/s on a shared 2-core Xeon


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors a step reads (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def read_bandwidth() -> float:
    """Bytes per second read by a reduction over PROBE_BYTES, the best of PROBE_REPEATS."""
    x = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    x.sum()  # first touch and thread start-up
    best = min(_timed(x.sum) for _ in range(PROBE_REPEATS))
    return PROBE_BYTES / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_rate(target, prompt: list[int], tokens: int | None = None) -> float:
    """Tokens per second of the target alone decoding `tokens` (DECODE_TOKENS) after `prompt`, its prefill not
    counted: the median of DECODE_REPEATS runs."""
    tokens = tokens or DECODE_TOKENS
    colocated_engine(target, None, 0, 1).generate([prompt], SamplingParams(max_tokens=4))  # warm-up
    rates = []
    for _ in range(DECODE_REPEATS):
        engine = colocated_engine(target, None, 0, 1)
        t0 = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
        rates.append(tokens / (time.perf_counter() - t0 - engine.stats.prefill_s))
    return statistics.median(rates)


def memory_floor(target, prompt: list[int]) -> dict:
    per_token = weight_bytes(target.model)
    bandwidth = read_bandwidth()
    floor = bandwidth / per_token
    rate = decode_rate(target, prompt)
    return {"bytes_per_token": per_token, "read_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
            "floor_tokens_per_s": round(floor, 2), "decode_batch1_tokens_per_s": round(rate, 2),
            "fraction_of_floor": round(rate / floor, 3)}
