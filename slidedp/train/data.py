"""Training data for the embedded default job: packed token rows from plain text.

- ``stdlib_source_files()``: the Python standard library's own ``.py`` files, real text every
  machine has.
- ``TokenStream`` / ``pack_sequences()``: tokenize documents lazily, put an EOS token after each
  document, concatenate and cut into rows of exactly ``seq_len`` tokens (the incomplete tail is
  dropped). Reading stops as soon as ``max_rows`` rows are filled, so asking for a few hundred rows
  tokenizes only the first few files. Optionally the packed rows are cached in a safetensors file.
- ``PackedDataset``: serves batches of rows (with labels and attention masks when it has them,
  see ``sources.py`` for a user's data) in a seeded, per-epoch shuffled order; its position
  exports to a small JSON-able dict for exact resume; ``split()`` holds out a validation set.

Everything is deterministic: the same documents, tokenizer and arguments give the same rows, and
the same seed gives the same batch sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sysconfig
import tokenize
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

Document = Union[str, "os.PathLike[str]"]

#: Directory names skipped by ``stdlib_source_files`` (installed packages, test suites, IDLE).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})

_CACHE_FORMAT = 1
_STATE_VERSION = 1
_PROBE_TEXT = "def probe(x):\n    return {'naïve': x ** 2}  # 0123\n"


# --------------------------------------------------------------------------------------------
# Documents


def stdlib_source_files(stdlib_dir: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted by their path relative to the stdlib root.

    ``stdlib_dir`` defaults to ``sysconfig.get_paths()["stdlib"]`` (in a virtual environment this
    is the base interpreter's library). Directories named in ``EXCLUDED_DIRS`` are not entered,
    and symbolic links to directories are not followed.
    """
    root = pathlib.Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library directory not found: {root}")
    found: list[tuple[tuple[str, ...], pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = pathlib.Path(dirpath, name)
                found.append((path.relative_to(root).parts, path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def read_document(doc: Document) -> str:
    """Text of a document: a ``str`` is the text itself, an ``os.PathLike`` is a file to read.

    Python files are decoded as Python does (PEP 263 coding cookie, default UTF-8); undecodable
    bytes are replaced rather than failing. For the standard library's sources of the default job
    only: a user's ``.txt`` data is read strictly by ``sources.read_text_file``.
    """
    if isinstance(doc, str):
        return doc
    if not isinstance(doc, os.PathLike):
        raise TypeError(f"a document is a str (text) or an os.PathLike (file), not {type(doc).__name__}")
    path = os.fspath(doc)
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (Hugging Face tokenizer call convention)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _resolve_eos(tokenizer: Any, eos_token_id: int | None) -> int:
    eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id= explicitly")
    return int(eos)


# --------------------------------------------------------------------------------------------
# Packing


class TokenStream:
    """Lazy stream of tokenized documents, each followed by an EOS token.

    Documents are read and tokenized one at a time, only when iteration reaches them; documents
    that are empty or whitespace-only are skipped. ``docs_read`` counts the documents read so far
    (skipped ones included) and ``tokens_read`` the tokens produced (EOS included).
    """

    def __init__(
        self,
        docs: Iterable[Document],
        tokenizer: Any,
        *,
        eos_token_id: int | None = None,
        max_docs: int | None = None,
    ):
        if max_docs is not None and max_docs < 0:
            raise ValueError(f"max_docs must be >= 0, got {max_docs}")
        self.docs = docs
        self.tokenizer = tokenizer
        self.eos_token_id = _resolve_eos(tokenizer, eos_token_id)
        self.max_docs = max_docs
        self.docs_read = 0
        self.tokens_read = 0

    def documents(self) -> Iterator[list[int]]:
        """Token ids of each non-empty document, EOS appended."""
        for doc in self.docs:
            if self.max_docs is not None and self.docs_read >= self.max_docs:
                return
            self.docs_read += 1
            text = read_document(doc)
            if not text.strip():
                continue
            ids = _encode(self.tokenizer, text)
            ids.append(self.eos_token_id)
            self.tokens_read += len(ids)
            yield ids

    def rows(self, seq_len: int, max_rows: int | None = None) -> Iterator[list[int]]:
        """Pack the stream into rows of exactly ``seq_len`` tokens; stop after ``max_rows`` rows
        (no further document is read) or when the documents run out (the tail is dropped)."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if max_rows is not None and max_rows <= 0:
            return
        buf: list[int] = []
        emitted = 0
        for ids in self.documents():
            buf.extend(ids)
            n_full = len(buf) // seq_len
            for i in range(n_full):
                yield buf[i * seq_len : (i + 1) * seq_len]
                emitted += 1
                if max_rows is not None and emitted >= max_rows:
                    return
            del buf[: n_full * seq_len]


def _tokenizer_fingerprint(tokenizer: Any, eos: int) -> dict:
    return {
        "class": type(tokenizer).__name__,
        "vocab": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
        "eos": eos,
        "probe": hashlib.sha256(json.dumps(_encode(tokenizer, _PROBE_TEXT)).encode()).hexdigest()[:16],
    }


def _docs_fingerprint(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        if isinstance(doc, str):
            h.update(b"T" + hashlib.sha256(doc.encode("utf-8", "surrogatepass")).digest())
        else:
            st = os.stat(doc)
            h.update(f"F{os.fspath(doc)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def pack_sequences(
    docs: Iterable[Document],
    tokenizer: Any,
    seq_len: int,
    *,
    max_rows: int | None = None,
    max_docs: int | None = None,
    eos_token_id: int | None = None,
    cache_path: str | os.PathLike | None = None,
) -> torch.Tensor:
    """Tokenize ``docs`` (``str`` = text, ``os.PathLike`` = file), put EOS after each document,
    concatenate and cut into rows of exactly ``seq_len`` tokens.

    Returns a LongTensor ``[n_rows, seq_len]`` (``n_rows`` may be 0). At most ``max_rows`` rows
    are produced and at most ``max_docs`` documents read; reading stops as soon as the rows are
    filled. ``eos_token_id`` defaults to ``tokenizer.eos_token_id``.

    With ``cache_path`` the rows are stored in (and later loaded from) a safetensors file keyed by
    the arguments, the tokenizer (vocabulary size, EOS, ids of a probe text) and the documents
    (file path, size and mtime, or the hash of a text); a key mismatch recomputes and overwrites.
    Fingerprinting materializes ``docs`` (a list of paths is cheap; texts are hashed).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    eos = _resolve_eos(tokenizer, eos_token_id)
    key = None
    if cache_path is not None:
        docs = list(docs)
        key = hashlib.sha256(
            json.dumps(
                {
                    "format": _CACHE_FORMAT,
                    "seq_len": seq_len,
                    "max_rows": max_rows,
                    "max_docs": max_docs,
                    "tokenizer": _tokenizer_fingerprint(tokenizer, eos),
                    "docs": _docs_fingerprint(docs),
                },
                sort_keys=True,
            ).encode()
        ).hexdigest()
        cached = _load_cached_rows(pathlib.Path(cache_path), key)
        if cached is not None:
            return cached

    stream = TokenStream(docs, tokenizer, eos_token_id=eos, max_docs=max_docs)
    rows = list(stream.rows(seq_len, max_rows))
    out = torch.tensor(rows, dtype=torch.long) if rows else torch.empty((0, seq_len), dtype=torch.long)

    if cache_path is not None:
        _save_cached_rows(pathlib.Path(cache_path), key, out, stream)
    return out


def _load_cached_rows(path: pathlib.Path, key: str) -> torch.Tensor | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("slidedp_key") != key:
                return None
            return f.get_tensor("rows")
    except Exception:  # unreadable or foreign file: recompute
        return None


def _save_cached_rows(path: pathlib.Path, key: str, rows: torch.Tensor, stream: TokenStream) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    meta = {"slidedp_key": key, "docs_read": str(stream.docs_read), "tokens_read": str(stream.tokens_read)}
    try:
        save_file({"rows": rows.contiguous()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# --------------------------------------------------------------------------------------------
# Dataset


class Batch(NamedTuple):
    """Rows of a dataset: input ids, and labels / attention mask where the dataset has them."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None


def _epoch_seed(seed: int, epoch: int, tag: str = "epoch") -> int:
    digest = hashlib.sha256(f"slidedp:{tag}:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PackedDataset:
    """Rows ``[N, seq_len]`` served in batches, reshuffled every epoch with a seeded permutation.

    ``next_batch(n)`` takes the next ``n`` rows of the current epoch's order and continues into
    the next epoch when the current one runs out, so every batch has exactly ``n`` rows. The
    order of epoch ``e`` depends only on ``(seed, e)``, so ``state_dict()`` (epoch, position,
    seed and a fingerprint of the rows) is enough to resume exactly. The rows tensor is shared,
    not copied: do not modify it.

    Optional ``labels`` (-100 where nothing is trained, e.g. prompt tokens or padding) and
    ``attention_mask`` (0 on padding) have the shape of ``rows`` and travel with them:
    ``next_fields`` / ``field_batches`` return all three as a ``Batch``.
    """

    def __init__(self, rows: torch.Tensor, *, seed: int = 0, shuffle: bool = True,
                 labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None):
        if rows.dim() != 2:
            raise ValueError(f"rows must be a 2-D [n_rows, seq_len] tensor, got shape {tuple(rows.shape)}")
        if rows.dtype != torch.long:
            raise TypeError(f"rows must be a LongTensor, got {rows.dtype}")
        for name, t in (("labels", labels), ("attention_mask", attention_mask)):
            if t is not None and (t.shape != rows.shape or t.dtype != torch.long):
                raise ValueError(f"{name} must be a LongTensor of the rows' shape {tuple(rows.shape)}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        self.rows = rows.contiguous()
        self.labels = None if labels is None else labels.contiguous()
        self.attention_mask = None if attention_mask is None else attention_mask.contiguous()
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._order_cache: tuple[int, torch.Tensor] | None = None
        self._fingerprint: str | None = None

    @classmethod
    def from_docs(
        cls,
        docs: Iterable[Document],
        tokenizer: Any,
        seq_len: int,
        *,
        max_rows: int | None = None,
        max_docs: int | None = None,
        eos_token_id: int | None = None,
        cache_path: str | os.PathLike | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> "PackedDataset":
        rows = pack_sequences(
            docs, tokenizer, seq_len, max_rows=max_rows, max_docs=max_docs,
            eos_token_id=eos_token_id, cache_path=cache_path,
        )
        return cls(rows, seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return self.rows.shape[0]

    @property
    def seq_len(self) -> int:
        return self.rows.shape[1]

    def fingerprint(self) -> str:
        """Short hash of the rows (shape and values), checked when a state is restored."""
        if self._fingerprint is None:
            h = hashlib.sha256(repr(tuple(self.rows.shape)).encode())
            h.update(self.rows.numpy().tobytes())
            for tag, t in ((b"labels", self.labels), (b"attention_mask", self.attention_mask)):
                if t is not None:
                    h.update(tag)
                    h.update(t.numpy().tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def _order(self, epoch: int) -> torch.Tensor:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self)
            if self.shuffle:
                g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                order = torch.randperm(n, generator=g)
            else:
                order = torch.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_batch(self, n_rows: int) -> torch.Tensor:
        """The next ``n_rows`` rows, LongTensor ``[n_rows, seq_len]`` (a new tensor)."""
        return self.rows.index_select(0, self._next_indices(n_rows))

    def next_fields(self, n_rows: int) -> Batch:
        """Like ``next_batch``, with the labels and attention mask of the same rows."""
        return self._select(self._next_indices(n_rows))

    def _select(self, idx: torch.Tensor) -> Batch:
        return Batch(*(None if t is None else t.index_select(0, idx)
                       for t in (self.rows, self.labels, self.attention_mask)))

    def _next_indices(self, n_rows: int) -> torch.Tensor:
        if n_rows < 1:
            raise ValueError(f"n_rows must be >= 1, got {n_rows}")
        if len(self) == 0:
            raise ValueError("the dataset is empty")
        picks = []
        need = n_rows
        while need > 0:
            order = self._order(self.epoch)
            take = min(need, len(self) - self.position)
            picks.append(order[self.position : self.position + take])
            self.position += take
            need -= take
            if self.position == len(self):
                self.epoch += 1
                self.position = 0
        return torch.cat(picks)

    def batches(self, n_rows: int, *, drop_last: bool = False) -> Iterator[torch.Tensor]:
        """All rows once, in stored order, in batches of ``n_rows`` (for evaluation; does not
        touch the epoch/position state). The last batch may be smaller unless ``drop_last``."""
        if n_rows < 1:
            raise ValueError(f"n_rows must be >= 1, got {n_rows}")
        for start in range(0, len(self), n_rows):
            batch = self.rows[start : start + n_rows]
            if drop_last and batch.shape[0] < n_rows:
                return
            yield batch

    def field_batches(self, n_rows: int) -> Iterator[Batch]:
        """Like ``batches`` (stored order, last batch may be smaller), as ``Batch`` tuples."""
        if n_rows < 1:
            raise ValueError(f"n_rows must be >= 1, got {n_rows}")
        for start in range(0, len(self), n_rows):
            yield self._select(torch.arange(start, min(start + n_rows, len(self))))

    def split(self, val_fraction: float, *, seed: int | None = None) -> tuple["PackedDataset", "PackedDataset"]:
        """``(train, val)``: a seeded random ``val_fraction`` of the rows is held out.

        At least one row goes to each side when ``0 < val_fraction < 1`` and there are two rows
        or more. Both sides keep the stored row order; ``train`` keeps this dataset's seed and
        shuffling, ``val`` does not shuffle. ``seed`` defaults to this dataset's seed.
        """
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        n = len(self)
        n_val = int(round(n * val_fraction))
        if val_fraction > 0 and n >= 2:
            n_val = min(max(n_val, 1), n - 1)
        g = torch.Generator().manual_seed(_epoch_seed(self.seed if seed is None else seed, 0, "split"))
        perm = torch.randperm(n, generator=g)
        val_idx = perm[:n_val].sort().values
        train_idx = perm[n_val:].sort().values
        t, v = self._select(train_idx), self._select(val_idx)
        train = PackedDataset(t.input_ids, seed=self.seed, shuffle=self.shuffle, labels=t.labels,
                              attention_mask=t.attention_mask)
        val = PackedDataset(v.input_ids, seed=self.seed, shuffle=False, labels=v.labels,
                            attention_mask=v.attention_mask)
        return train, val

    def state_dict(self) -> dict:
        """JSON-able position state: ``{"version", "seed", "shuffle", "epoch", "position",
        "num_rows", "seq_len", "fingerprint"}``."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": len(self),
            "seq_len": self.seq_len,
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by ``state_dict()``; the rows must be the same (checked)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported dataset state version {state.get('version')!r}")
        if (state["num_rows"], state["seq_len"], state["fingerprint"]) != (
            len(self), self.seq_len, self.fingerprint()
        ):
            raise ValueError(
                "dataset state was saved for different data: "
                f"{state['num_rows']}x{state['seq_len']} rows, fingerprint {state['fingerprint']}; "
                f"this dataset has {len(self)}x{self.seq_len}, fingerprint {self.fingerprint()}"
            )
        position = int(state["position"])
        if not 0 <= position < max(len(self), 1):
            raise ValueError(f"position {position} out of range for {len(self)} rows")
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = position
        self._order_cache = None


def stdlib_dataset(
    tokenizer: Any,
    seq_len: int,
    *,
    max_rows: int,
    seed: int = 0,
    eos_token_id: int | None = None,
    cache_path: str | os.PathLike | None = None,
) -> PackedDataset:
    """The default job's data: the first ``max_rows`` packed rows of the standard library's
    source files (files in sorted order; only as many files as needed are tokenized)."""
    return PackedDataset.from_docs(
        stdlib_source_files(), tokenizer, seq_len, max_rows=max_rows,
        eos_token_id=eos_token_id, cache_path=cache_path, seed=seed,
    )


__all__ = [
    "Batch",
    "EXCLUDED_DIRS",
    "PackedDataset",
    "TokenStream",
    "pack_sequences",
    "read_document",
    "stdlib_dataset",
    "stdlib_source_files",
]
