"""The run stage around the backend: launch.py (allocate and start the ranks), engine.py (the Engine),
checkpoint.py, preflight.py (memory checks before allocating), weights.py (initial weights)."""
