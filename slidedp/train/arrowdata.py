"""A user's data through Hugging Face `datasets`: each source tokenized once into an Arrow cache.

Sources (``sources.find_data_files``): ``.jsonl``, ``.txt`` and ``.parquet`` files, and folders written
by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: its ``train`` split, or its only one).
Each source's examples (the shapes of ``sources.py``: text, prompt/completion, chat) are tokenized by
a generator that `datasets.Dataset.from_generator` writes to Arrow as it goes, so a corpus larger than
memory streams through; the result is memory-mapped. Readers:

- ``.parquet``: ``datasets.load_dataset("parquet", streaming=True)`` (no copy of the file is made);
- a ``save_to_disk`` folder: ``datasets.load_from_disk``;
- ``.txt``: the whole file one text, decoded strictly as ``encoding`` (``sources.read_text_file``);
- ``.jsonl``: read line by line by ``sources`` (strict UTF-8 and JSON, errors naming file and line).
  ``datasets.load_dataset("json")`` is not used: it unifies every line into one schema, so a line
  without ``text`` reads as ``text: null``, a number among strings passes as JSON, and a syntax error
  is reported by row of a block, not by the file's line.

Cache: ``<cache>/<key>/``, ``<cache>`` the argument ``cache_dir``, else ``$SLIDEDP_DATA_CACHE``,
else ``$XDG_CACHE_HOME/slidedp/data`` (``~/.cache/slidedp/data``). The key hashes the source's
absolute path, size and modification time (every file's, for a folder), its kind, the ``.txt``
encoding and the tokenizer (its whole ``tokenizer.json`` when fast, its chat template, special tokens
and the ids of a probe text), so a second run with the same files and tokenizer reads the token rows
back without tokenizing; any change makes a new entry (old ones may be deleted at any time). The rows
do not depend on ``seq_len``: packing and padding are done from the cached tokens, vectorized. Nothing
contacts the Hub: `datasets` runs with ``HF_DATASETS_OFFLINE`` while loading.

The rows equal those of ``sources.build_rows`` over ``sources.iter_examples`` (same order, packing,
padding and masking), so a checkpoint's data position fits either. Unlike that lazy reader, every
example of a source is read and checked, even past ``max_rows``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slidedp.train.data import PackedDataset, _resolve_eos, _tokenizer_fingerprint
from slidedp.train.sources import (
    Example, _example, _jsonl_examples, find_data_files, packed_dataset, read_text_file, set_chat_template,
    tokenize_example,
)

CACHE_ENV = "SLIDEDP_DATA_CACHE"
CACHE_FORMAT = 1  # bump when the tokenized records change meaning
TEXT, PROMPT, CHAT = 0, 1, 2  # the shape of an example: every token trained, a prompt masked, a conversation


def default_cache_dir() -> Path:
    """``$SLIDEDP_DATA_CACHE``, else ``$XDG_CACHE_HOME/slidedp/data`` (``~/.cache/slidedp/data``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "slidedp" / "data"


def _kind(path: Path) -> str:
    return "folder" if path.is_dir() else path.suffix[1:]


def where(path: Path, kind: str, line: int) -> str:
    """How an error names an example: "data file F line N", "... row N", "data folder F row N"."""
    if kind == "txt":
        return f"data file {path}"
    if kind == "folder":
        return f"data folder {path} row {line}"
    return f"data file {path} {'line' if kind == 'jsonl' else 'row'} {line}"


# --------------------------------------------------------------------------------------------
# Reading examples


@contextlib.contextmanager
def _quiet_offline():
    """`datasets` with no progress bars and no Hub access (restored after)."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    offline = datasets.config.HF_DATASETS_OFFLINE
    datasets.disable_progress_bars()
    datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield datasets
    finally:
        datasets.config.HF_DATASETS_OFFLINE = offline
        if bars:
            datasets.enable_progress_bars()


def _columns(names: list[str], what: str) -> list[str]:
    """The columns an example is made of, as ``sources._parquet_examples`` picks them."""
    if "messages" in names:
        return ["messages"]
    if "conversations" in names:
        return ["conversations"]
    if "text" in names:
        return ["text"]
    if {"prompt", "completion"} <= set(names):
        return ["prompt", "completion"]
    raise ValueError(f"{what}: expected a 'text' column, or 'prompt' and 'completion', or 'messages' (or "
                     f"'conversations') (found {sorted(names)})")


def _saved_dataset(path: Path):
    """The `datasets.Dataset` of a ``save_to_disk`` folder (a DatasetDict's train or only split)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError, FileNotFoundError) as exc:
        raise ValueError(f"data folder {path}: not a readable save_to_disk folder "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise ValueError(f"data folder {path}: a DatasetDict with the splits {', '.join(loaded)} and no 'train'; "
                         "save the split to train on with save_to_disk")
    return loaded


def _parquet_rows(path: Path) -> Iterator[dict]:
    import datasets
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"data file {path}: not a readable parquet file ({' '.join(str(exc).split())})") from None
    stream = datasets.load_dataset("parquet", data_files=[str(path)], split="train", streaming=True)
    yield from stream.select_columns(_columns(names, f"data file {path}"))


def examples_of(path: Path, encoding: str = "utf-8") -> Iterator[tuple[int, Example]]:
    """(line or row, example) of one source, in order; a source without any example is refused."""
    kind = _kind(path)
    count = 0
    if kind == "txt":
        text = read_text_file(path, encoding)
        if text.strip():
            count += 1
            yield -1, Example(text, source=where(path, kind, -1))
    elif kind == "jsonl":
        for example in _jsonl_examples(path):
            count += 1
            yield int(example.source.rsplit(" ", 1)[1]), example
    else:
        if kind == "folder":
            dataset = _saved_dataset(path)
            rows = iter(dataset.select_columns(_columns(dataset.column_names, f"data folder {path}")))
        elif kind == "parquet":
            rows = _parquet_rows(path)
        else:
            raise ValueError(f"data file {path}: not a .txt, .jsonl or .parquet file, nor a save_to_disk folder")
        for row, record in enumerate(rows):
            count += 1
            yield row, _example(record, where(path, kind, row))
    if count == 0:
        raise ValueError(f"{'data folder' if kind == 'folder' else 'data file'} {path} is empty: it holds no example "
                         f"({'only whitespace' if kind == 'txt' else 'no line with data'}); remove it or fill it")


def _records(path: Path, tokenizer: Any, encoding: str) -> Iterator[dict]:
    """The tokenized records of a source: input_ids, labels (-100 where not trained), line (for errors)
    and shape (TEXT, PROMPT or CHAT)."""
    eos = _resolve_eos(tokenizer, None)
    for line, example in examples_of(path, encoding):
        ids, labels = tokenize_example(example, tokenizer, eos)
        if len(ids) < 2:
            raise ValueError(f"{example.source}: gives {len(ids)} token(s) with EOS; a next-token loss needs at "
                             "least 2")
        shape = CHAT if example.messages is not None else PROMPT if example.prompt is not None else TEXT
        yield {"input_ids": ids, "labels": labels, "line": line, "shape": shape}


# --------------------------------------------------------------------------------------------
# The cache


def tokenizer_key(tokenizer: Any) -> str:
    """A hash of everything of the tokenizer that the tokens depend on."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    template = getattr(tokenizer, "chat_template", None)
    h.update(json.dumps({"fingerprint": _tokenizer_fingerprint(tokenizer, _resolve_eos(tokenizer, None)),
                         "chat_template": template if isinstance(template, (str, dict, type(None))) else str(template),
                         "special": [str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ()]},
                        sort_keys=True, default=str).encode())
    return h.hexdigest()


def source_key(path: Path, tokenizer_hash: str, encoding: str) -> str:
    """The cache key of a source: its files' paths, sizes and modification times, its kind, the
    encoding (``.txt``) and the tokenizer's hash."""
    path = path.resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [(str(p), (st := p.stat()).st_size, st.st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps({
        "format": CACHE_FORMAT, "kind": _kind(path), "files": stats, "tokenizer": tokenizer_hash,
        "encoding": encoding if path.suffix == ".txt" else None,
    }).encode()).hexdigest()[:32]


def tokenized(path: Path, tokenizer: Any, *, encoding: str = "utf-8", cache_dir: str | os.PathLike | None = None,
              tokenizer_hash: str | None = None):
    """The tokenized records of one source as a memory-mapped `datasets.Dataset`, from the cache when
    an entry of its key exists, else tokenized now (errors name the file and line) and cached."""
    from datasets import Features, Sequence, Value

    key = source_key(path, tokenizer_hash or tokenizer_key(tokenizer), encoding)
    entry = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = entry / key
    features = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
                         "line": Value("int64"), "shape": Value("int8")})
    with _quiet_offline() as datasets:
        try:
            return datasets.Dataset.from_generator(
                _records, features=features, cache_dir=str(entry), fingerprint=key,
                gen_kwargs={"path": path, "tokenizer": tokenizer, "encoding": encoding})
        except datasets.exceptions.DatasetGenerationError as exc:  # our ValueError, wrapped by the builder
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, (ValueError, ImportError, OSError)):
                raise cause from None
            raise


def is_cached(path: Path, tokenizer: Any, *, encoding: str = "utf-8",
              cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether `tokenized` would read `path` from the cache."""
    key = source_key(path, tokenizer_key(tokenizer), encoding)
    entry = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / key
    return any(entry.glob("generator/*/*/dataset_info.json"))


# --------------------------------------------------------------------------------------------
# Rows


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a chunked Arrow list column, as int64 arrays."""
    import pyarrow.compute as pc

    values, lengths = [], []
    for chunk in column.chunks:
        values.append(chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int64))
        lengths.append(pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64))
    empty = np.zeros(0, np.int64)
    return (np.concatenate(values) if values else empty), (np.concatenate(lengths) if lengths else empty)


def rows_of(parts: list[tuple[Path, Any]], seq_len: int, pad: int, *, packing: bool,
            max_rows: int | None = None) -> dict[str, torch.Tensor | None]:
    """``{"input_ids", "labels", "attention_mask"}`` rows of the tokenized sources ``(path, dataset)``,
    in order, exactly as ``sources.build_rows`` makes them from the same examples."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    ids, labels, lengths, shapes, lines, owner = [], [], [], [], [], []
    for k, (_, dataset) in enumerate(parts):
        table = dataset.data
        v, n = _flat(table.column("input_ids"))
        ids.append(v)
        labels.append(_flat(table.column("labels"))[0])
        lengths.append(n)
        shapes.append(table.column("shape").to_numpy(zero_copy_only=False))
        lines.append(table.column("line").to_numpy(zero_copy_only=False))
        owner.append(np.full(len(n), k))
    ids_flat, labels_flat = np.concatenate(ids), np.concatenate(labels)
    lengths, shapes = np.concatenate(lengths), np.concatenate(shapes)
    lines, owner = np.concatenate(lines), np.concatenate(owner)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    limit = len(lengths) if max_rows is None else max(0, min(max_rows, len(lengths)))

    def tensor(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    if packing:
        n_full = len(ids_flat) // seq_len
        row_ids = ids_flat[: n_full * seq_len].reshape(n_full, seq_len)
        row_labels = labels_flat[: n_full * seq_len].reshape(n_full, seq_len)
        kept = np.flatnonzero((row_labels[:, 1:] != -100).any(axis=1))
        if max_rows is not None:
            kept = kept[: max(0, max_rows)]
        # the examples read before the last row filled decide whether labels are kept (as build_rows)
        read = len(lengths)
        if max_rows is not None and len(kept) == max(0, max_rows):  # stopped at the example that filled the last
            read = int(np.searchsorted(np.cumsum(lengths), (kept[-1] + 1) * seq_len)) + 1 if len(kept) else 0
        any_masked = bool((shapes[:read] != TEXT).any())
        return {"input_ids": tensor(row_ids[kept]), "labels": tensor(row_labels[kept]) if any_masked else None,
                "attention_mask": None}

    starts, kept_len = starts[:limit], np.minimum(lengths[:limit], seq_len)
    trained = np.concatenate([[0], np.cumsum(labels_flat != -100)])
    untrained = np.flatnonzero(trained[starts + kept_len] - trained[starts + 1] == 0)
    if len(untrained):
        i = int(untrained[0])
        path = Path(parts[owner[i]][0])
        what = "the turns before the first assistant reply fill" if shapes[i] == CHAT else "the prompt fills"
        raise ValueError(f"{where(path, _kind(path), int(lines[i]))}: {what} the whole row of "
                         f"seq_len={seq_len} tokens, so no completion token is trained (all labels -100); raise "
                         "seq_len, shorten the prompt, or use packing=true")
    row = np.repeat(np.arange(limit), kept_len)
    col = np.arange(int(kept_len.sum())) - np.repeat(np.cumsum(kept_len) - kept_len, kept_len)
    src = np.repeat(starts, kept_len) + col
    row_ids = np.full((limit, seq_len), pad, np.int64)
    row_labels = np.full((limit, seq_len), -100, np.int64)
    mask = np.zeros((limit, seq_len), np.int64)
    row_ids[row, col], row_labels[row, col], mask[row, col] = ids_flat[src], labels_flat[src], 1
    return {"input_ids": tensor(row_ids), "labels": tensor(row_labels), "attention_mask": tensor(mask)}


# --------------------------------------------------------------------------------------------
# The dataset


def load_arrow_dataset(spec: str, tokenizer: Any, seq_len: int, *, packing: bool = True,
                       max_rows: int | None = None, seed: int = 0, encoding: str = "utf-8", chat_template: str = "",
                       key: str = "data", cache_dir: str | os.PathLike | None = None) -> PackedDataset:
    """A ``PackedDataset`` of the sources named by `spec` (as ``loading.load_dataset``), each tokenized
    through the Arrow cache (`tokenized`)."""
    set_chat_template(tokenizer, chat_template)
    files = find_data_files(spec, key)
    tokenizer_hash = tokenizer_key(tokenizer)
    parts = [(path, tokenized(path, tokenizer, encoding=encoding, cache_dir=cache_dir, tokenizer_hash=tokenizer_hash))
             for path in files]
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = _resolve_eos(tokenizer, None) if pad is None else int(pad)
    rows = rows_of(parts, seq_len, pad, packing=packing, max_rows=max_rows)
    return packed_dataset(rows, spec=spec, key=key, seq_len=seq_len, packing=packing, seed=seed)


__all__ = ["CACHE_ENV", "default_cache_dir", "examples_of", "is_cached", "load_arrow_dataset", "rows_of",
           "source_key", "tokenized", "tokenizer_key", "where"]
