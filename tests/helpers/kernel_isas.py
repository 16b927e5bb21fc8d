"""Each kernel of starjar's own products (starjar.cpu.few_rows) that this CPU has, forced in turn by a fixture;
AVX-512's three times: its weight rows interleaved, streamed one at a time, and streamed two runs a thread at once
(the same values every way)."""

import pytest
import torch

from starjar.cpu import few_rows

STREAMED = "-streamed"  # the suffix of AVX-512 with every row count's weight rows streamed
TWINNED = "-twinned"  # ... streamed, two runs of them a thread at once


def isas() -> list[str]:
    best = torch.ops.starjar.few_rows_isa() if few_rows.available() else 0
    names = [name for name, code in few_rows.ISAS.items() if code <= best]
    return names + [name + way for name in names if name == "avx512" for way in (STREAMED, TWINNED)]


@pytest.fixture(params=isas())
def isa(request, monkeypatch):
    """STARJAR_FEW_ROWS_ISA set to each kernel in turn (AVX-512 takes VNNI's int8 tiles where the CPU has it,
    AVX2 its own; AVX-512 interleaved, streamed, twinned), the best kernel and the mask handed back after."""
    name = request.param.removesuffix(STREAMED).removesuffix(TWINNED)
    before = few_rows.stream_mask()
    monkeypatch.setenv(few_rows.ISA_ENV, name)
    few_rows.set_stream({STREAMED: few_rows.ALL_STREAMED & ~few_rows.TWINNED, TWINNED: few_rows.ALL_STREAMED}.get(
        request.param.removeprefix(name), 0))
    yield name
    monkeypatch.delenv(few_rows.ISA_ENV)
    few_rows.use_forced_isa()
    few_rows.set_stream(before)
