"""Stage 2, IR -> costs: the analytical model of a step's time and memory.

hardware.py  Hardware: a host and its GPUs as a handful of rates (presets, calibrated profiles)
ops.py       the duration of each scheduled operation, a small pure function each
memory.py    the bytes of each device buffer
"""
