"""What judges decisions: timeline.py (the simulator that defines a step's time), critical_path.py (the
chain of operations that sets it), closed_form.py (the same number without a timeline), brute_force.py
(every decision of a small problem, for tests)."""
