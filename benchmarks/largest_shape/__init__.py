"""benchmarks/largest_shape."""
