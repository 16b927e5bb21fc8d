"""What every benchmark result and figure names about the machine: the CPU, its capability, torch, threads
and the kernel paths this process chose."""

from __future__ import annotations

import torch

from starjar.cpu import skinny_linear
from starjar.cpu.kernels import cached_entries, compute_threads, cpu_model, isa_limits
from starjar.cpu.quantized import int8_path


def machine_info() -> dict:
    """What every benchmark JSON and README figure names: the CPU, its capability, torch and threads."""
    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": compute_threads(),
            "quantized_engine": torch.backends.quantized.engine, "int8_kernel": int8_path(),
            "fp32_few_rows": fp32_few_rows(), "isa_limits": isa_limits()}


def fp32_few_rows() -> dict:
    """The few-rows fp32 linear paths this process chose (starjar.cpu.skinny_linear), by model shapes; forced or
    not chosen yet when empty."""
    if skinny_linear.forced():
        return {"forced": skinny_linear.forced()}
    return {name.rsplit("|", 1)[-1]: {k: e["paths"][k] for k in ("body", "head", "head_one") if k in e["paths"]}
            for name, e in cached_entries().items() if f"|{skinny_linear.KIND}|" in name and "paths" in e}
