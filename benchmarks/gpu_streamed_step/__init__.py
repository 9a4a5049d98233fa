"""benchmarks/gpu_streamed_step."""
