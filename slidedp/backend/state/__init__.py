"""Training state: host_state.py (the one authoritative copy, in shared memory), device_state.py (the
layers whose optimizer state the plan keeps on the device), step_flags.py (signals between ranks)."""
