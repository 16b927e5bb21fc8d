"""Each kernel of starjar's own products (starjar.cpu.few_rows) that this CPU has, forced in turn by a fixture."""

import pytest
import torch

from starjar.cpu import few_rows


def isas() -> list[str]:
    best = torch.ops.starjar.few_rows_isa() if few_rows.available() else 0
    return [name for name, code in few_rows.ISAS.items() if code <= best]


@pytest.fixture(params=isas())
def isa(request, monkeypatch):
    """STARJAR_FEW_ROWS_ISA set to each kernel in turn (AVX-512 takes VNNI's int8 tiles where the CPU has it,
    AVX2 its own), the best kernel handed back after."""
    monkeypatch.setenv(few_rows.ISA_ENV, request.param)
    yield request.param
    monkeypatch.delenv(few_rows.ISA_ENV)
    few_rows.use_forced_isa()
