"""Skipping what needs the fused projections' products where this machine does not give their bits."""

import pytest


def needs_exact_fusion(model) -> None:
    """The fused and native passes run products over the concatenated projections, taken only where those give
    the separate products' bits (starjar.model.fused_projections); where they do not (MKL's GEMV for q/k/v
    on a 2-core AMD EPYC, AVX2) those passes are never taken and there is nothing to compare."""
    if not model.lean_target.exact:
        pytest.skip("products over the fused projections differ in the last bits on this machine")
