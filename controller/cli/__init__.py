"""The `starjar` command line: argparse and printing; the work is in cluster/, tuning/ and the services."""
