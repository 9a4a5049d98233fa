"""benchmarks/gpu_worker_path."""
