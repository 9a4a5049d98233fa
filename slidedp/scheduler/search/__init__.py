"""Search strategies, each `search(costs, budget_bytes, start) -> Found | None` (found.py): cpsat.py,
baselines.py, local_search.py, early_order.py (updates during the backward), streamed_prefix.py
(updates streamed through the device)."""
