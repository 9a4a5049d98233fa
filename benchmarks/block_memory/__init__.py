"""benchmarks/block_memory."""
