"""Benchmark: data sets, the side-by-side runner and its report."""
