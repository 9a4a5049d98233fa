"""A model whose blocks take a multiprocessing lock in each rank's process, as tqdm does when inductor
compiles blocks; light to import (torch only), since each rank's process imports it to unpickle it."""

import multiprocessing
import os

import torch
from torch import nn


class LockingBlock(nn.Module):
    """A residual MLP block; the first forward in a rank's process takes a lock and leaves a file named
    by the process id in $LOCKS_DIR."""

    lock = None

    def __init__(self, dim: int):
        super().__init__()
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        if LockingBlock.lock is None and multiprocessing.current_process().name.startswith("slidedp-rank"):
            LockingBlock.lock = multiprocessing.RLock()
            open(os.path.join(os.environ["LOCKS_DIR"], str(os.getpid())), "w").close()
        return x + self.ff(x)


class LockingLM(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 32, n_blocks: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LockingBlock(dim) for _ in range(n_blocks))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.out(x)
