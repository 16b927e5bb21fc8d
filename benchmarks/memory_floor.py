"""How far the target's decoding is from the memory floor on this machine.

At batch 1 a decode step reads every weight once (a tied embedding and head once), so no engine decodes
faster than the machine's read bandwidth over those bytes. The bandwidth is probed here: the sum of a float32
array far larger than the caches, best of a few repeats, on the benchmark's threads. The target's decode rate
is one prompt's 64 new tokens at batch 1, gamma 0, prefill left out. A shared machine's bandwidth drifts
within minutes (26-37 GB/s between runs on a 2-core AMD EPYC), so each decode run is weighed against a probe
taken just before it, and the fraction is the median over the runs.

The floor is the best of a few short reductions (as STREAM reports), but a decode run lasts about a second. On a
2-core AMD EPYC (Zen 4) the read rate flipped between about 31 and 52 GB/s within seconds (reductions of 512 MiB,
one after another), so a best of five caught the faster state where a one-second run averaged over both. Each run
is therefore also weighed against the sustained rate: reductions repeated for as long as a decode run lasts, just
before it and just after it, their mean.
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
DECODE_REPEATS = 5  # one run of the same code varied from 27 to 34 tokens/s on a shared 2-core Xeon
SUSTAIN_S = 0.75  # seconds of reductions a sustained probe repeats: about one decode run of DECODE_TOKENS


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors a step reads (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def read_bandwidth(x: torch.Tensor | None = None) -> float:
    """Bytes per second read by a reduction over x (PROBE_BYTES of ones where None), the best of PROBE_REPEATS."""
    if x is None:
        x = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
        x.sum()  # first touch and thread start-up
    best = min(_timed(x.sum) for _ in range(PROBE_REPEATS))
    return x.numel() * x.element_size() / best


def sustained_bandwidth(x: torch.Tensor, seconds: float | None = None) -> float:
    """Bytes per second read by reductions over x repeated for `seconds` (SUSTAIN_S), all of them counted."""
    seconds = SUSTAIN_S if seconds is None else seconds
    count, t0 = 0, time.perf_counter()
    while True:
        x.sum()
        count += 1
        took = time.perf_counter() - t0
        if took >= seconds:
            return count * x.numel() * x.element_size() / took


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_once(target, prompt: list[int], tokens: int) -> float:
    """Tokens per second of one run of the target alone at batch 1 decoding `tokens` after `prompt`, its prefill
    not counted."""
    engine = colocated_engine(target, None, 0, 1)
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
    return tokens / (time.perf_counter() - t0 - engine.stats.prefill_s)


def decode_rate(target, prompt: list[int], tokens: int | None = None) -> float:
    """Tokens per second of the target alone decoding `tokens` (DECODE_TOKENS) after `prompt`, its prefill not
    counted: the median of DECODE_REPEATS runs."""
    tokens = tokens or DECODE_TOKENS
    colocated_engine(target, None, 0, 1).generate([prompt], SamplingParams(max_tokens=4))  # warm-up
    return statistics.median(decode_once(target, prompt, tokens) for _ in range(DECODE_REPEATS))


def memory_floor(target, prompt: list[int]) -> dict:
    """The floor and the decode rate, each decode run against the bandwidth probed just before it."""
    per_token = weight_bytes(target.model)
    x = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    x.sum()
    colocated_engine(target, None, 0, 1).generate([prompt], SamplingParams(max_tokens=4))  # warm-up
    runs = []
    for _ in range(DECODE_REPEATS):
        bandwidth = read_bandwidth(x)
        before = sustained_bandwidth(x)
        rate = decode_once(target, prompt, DECODE_TOKENS)
        runs.append((bandwidth, (before + sustained_bandwidth(x)) / 2, rate))
    bandwidth = statistics.median(b for b, _, _ in runs)
    sustained = statistics.median(s for _, s, _ in runs)
    rate = statistics.median(r for _, _, r in runs)
    return {"bytes_per_token": per_token, "read_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
            "floor_tokens_per_s": round(bandwidth / per_token, 2), "decode_batch1_tokens_per_s": round(rate, 2),
            "decode_gb_per_s": round(rate * per_token / 1e9, 2),
            "fraction_of_floor": round(statistics.median(r * per_token / b for b, _, r in runs), 3),
            "sustained_read_gb_per_s": round(sustained / 1e9, 2),
            "fraction_of_sustained": round(statistics.median(r * per_token / s for _, s, r in runs), 3),
            "runs": [{"read_bandwidth_gb_per_s": round(b / 1e9, 2), "sustained_read_gb_per_s": round(s / 1e9, 2),
                      "decode_tokens_per_s": round(r, 2)} for b, s, r in runs]}
