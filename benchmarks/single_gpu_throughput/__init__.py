"""benchmarks/single_gpu_throughput."""
