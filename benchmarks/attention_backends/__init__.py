"""benchmarks/attention_backends."""
