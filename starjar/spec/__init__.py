"""Speculation math: sampling, verification (chains and trees), tree selection, policies, proposers."""
