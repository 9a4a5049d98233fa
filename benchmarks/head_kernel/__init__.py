"""benchmarks/head_kernel."""
