"""benchmarks/block_rate."""
