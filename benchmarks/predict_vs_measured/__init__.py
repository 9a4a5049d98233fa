"""benchmarks/predict_vs_measured."""
