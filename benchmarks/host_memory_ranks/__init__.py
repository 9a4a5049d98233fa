"""benchmarks/host_memory_ranks."""
