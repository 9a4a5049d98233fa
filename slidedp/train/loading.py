"""The training data as a ``PackedDataset``: through Hugging Face `datasets` and its Arrow cache
(arrowdata.py) when it is installed, else through the plain reader of sources.py (the same rows)."""

from __future__ import annotations

import os
import warnings
from typing import Any

from slidedp.train.arrowdata import load_arrow_dataset
from slidedp.train.data import PackedDataset
from slidedp.train.sources import have_datasets, read_plain_dataset

_warned_no_datasets = False


def load_dataset(spec: str, tokenizer: Any, seq_len: int, *, packing: bool = True, max_rows: int | None = None,
                 seed: int = 0, encoding: str = "utf-8", chat_template: str = "", key: str = "data",
                 cache_dir: str | os.PathLike | None = None) -> PackedDataset:
    """A ``PackedDataset`` (with labels and masks where needed) from the files named by ``spec``
    (``.txt`` files decoded as `encoding`). `chat_template` (a Jinja string or file; "": the
    tokenizer's own) is set on the tokenizer for the conversations; `key` names the config key in
    errors.

    Through Hugging Face `datasets` and its Arrow cache (``arrowdata.load_arrow_dataset``, `cache_dir`
    its folder) when `datasets` is installed; else, after one warning naming the package, by
    ``sources.read_plain_dataset`` (the same rows; a ``save_to_disk`` folder then is refused)."""
    global _warned_no_datasets
    kwargs = dict(packing=packing, max_rows=max_rows, seed=seed, encoding=encoding, chat_template=chat_template,
                  key=key)
    if have_datasets():
        return load_arrow_dataset(spec, tokenizer, seq_len, cache_dir=cache_dir, **kwargs)
    if not _warned_no_datasets:
        _warned_no_datasets = True
        warnings.warn("the package 'datasets' is not installed: reading the data without its Arrow cache (every "
                      "run tokenizes again); pip install 'datasets>=4.3'", stacklevel=2)
    return read_plain_dataset(spec, tokenizer, seq_len, **kwargs)
