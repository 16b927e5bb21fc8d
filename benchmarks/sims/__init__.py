"""Simulators the benchmarks replay: the star fabric and Nightjar's target worker."""
