"""A plan's schedule -> a Program: program.py (lower), weight_window.py (slots per visit),
verify.py (happens-before, buffers and peak memory, replayed without running)."""
