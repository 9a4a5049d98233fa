"""benchmarks/tools."""
