"""benchmarks/cpu_adamw."""
