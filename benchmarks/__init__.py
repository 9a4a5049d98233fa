"""Benchmarks of slidedp: one package per study (run.py), shared code in benchmarks.common."""
