"""One-off measurements run as scripts (`python benchmarks/probes/NAME.py`)."""
