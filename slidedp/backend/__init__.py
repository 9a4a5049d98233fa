"""Stages 4 and 5, plan -> program -> run.

kernels/   Triton kernels of the gradient path and the Numba CPU AdamW
state/     the host state (shared memory), device-resident optimizer state, cross-process flags
lowering/  a plan's schedule -> Program (stream/event ops), and its verifier
runtime/   the executor of a Program, routes, a rank's step, worker processes, update threads
"""
