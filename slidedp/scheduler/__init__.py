"""Stage 3, costs -> plan: a schedule chosen under the device-memory budget.

plan.py       the Plan (plain data): Schedule, what the executor honours, and Explanation
decisions.py  the decision space (Decisions, LayerChoice) and SolverOptions
problem/      the problem: per-option costs in ticks, the device footprint, the lanes of a step
oracles/      what judges decisions: the timeline simulator, its closed form, brute force
search/       strategies, one result type (Found): CP-SAT, baselines, local search, the
              early-update order and the streamed-update prefix
explain.py    per-group predictions and each decision against its runner-up
solve.py      the driver: smallest budget, heuristics, CP-SAT per window, the best, the Plan
replay.py     a saved plan's decisions simulated again, under its hardware or another
"""
