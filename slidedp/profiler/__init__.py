"""Measurement, apart from the cost model it feeds: calibrate.py (`slidedp calibrate`: this machine's
rates into a Hardware profile), bench.py (`slidedp bench`: slidedp against plain PyTorch)."""
