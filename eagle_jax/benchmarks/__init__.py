"""Benchmarks: kernels, decoding speed, peers, drift diagnostics, report."""
