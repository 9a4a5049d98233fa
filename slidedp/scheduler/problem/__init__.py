"""The scheduling problem: costs.py (per-option costs in ticks), footprint.py (device memory over
program order), lanes.py (the ops of one step on their lanes, and the window's load order)."""
