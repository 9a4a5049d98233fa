"""benchmarks/diagnose_step."""
