"""A plan's schedule -> a Program: program.py (lower), weight_window.py (the slot of each block visit),
graph.py (the ops' dependency graph), verify.py (deadlock, happens-before, buffers and peak memory,
replayed without running)."""
