"""benchmarks/multi_gpu_scaling."""
