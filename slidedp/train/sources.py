"""A user's training data: ``.txt``, ``.jsonl`` and ``.parquet`` files or folders, as token rows.

Formats (an *example* is a text, every token trained, or a prompt and a completion, where the
prompt's tokens get label -100 so that only the completion is trained):

- ``.txt``: each file is one text, decoded strictly as ``encoding`` (config key, default UTF-8; a
  leading UTF-8 BOM is dropped); undecodable bytes are refused, naming the file and the byte offset.
- ``.jsonl``: one JSON object a line, with a ``text`` field, or ``prompt`` and ``completion``;
  blank lines are skipped.
- ``.parquet``: a ``text`` column, or ``prompt`` and ``completion`` columns (needs ``pyarrow``,
  imported only when a parquet file is read).

``data`` names files and folders, comma-separated; a folder contributes every file of these
kinds below it, in sorted order. Examples are read lazily and reading stops once ``max_rows``
rows are filled.

Two ways to make rows of exactly ``seq_len`` tokens:

- packing (``packing=True``): each example's tokens, then EOS, are concatenated and cut into
  rows (the incomplete tail is dropped). No attention mask: examples in a row see each other,
  as in the usual packed training. For plain texts this gives exactly the rows of
  ``data.pack_sequences``.
- padding (``packing=False``): one example a row, truncated to ``seq_len``, EOS appended if it
  fits, filled with the pad token (the tokenizer's, else EOS); ``attention_mask`` is 0 and the
  label -100 on the filling.

Bad data is refused with an error naming the file, the line (or parquet row) and the field: a line
that is not JSON or not UTF-8, a missing or non-string field, an empty text or completion, a file
with no example at all; and, when padding, an example whose prompt fills the whole row (all its
labels would be -100). When packing, a row that holds only prompt tokens (a long prompt cut across
rows) is dropped; if no row is left, the error says so.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slidedp.train.data import PackedDataset, _encode, _resolve_eos

SUFFIXES = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Example:
    text: str  # the text, or the completion
    prompt: str | None = None  # None: a plain text, every token trained
    source: str = field(default="", compare=False)  # "data file F line N": where it came from, for errors


def find_data_files(spec: str) -> list[Path]:
    """The files named by ``spec`` (comma-separated files and folders), folders expanded."""
    files: list[Path] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        path = Path(part).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise FileNotFoundError(f"config key 'data': folder {part} holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"config key 'data': {part} is not a {', '.join(SUFFIXES)} file")
            files.append(path)
        else:
            raise FileNotFoundError(f"config key 'data': {part} does not exist")
    if not files:
        raise FileNotFoundError(f"config key 'data': no data files in {spec!r}")
    return files


def _example(obj: Any, where: str) -> Example:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with 'text', or 'prompt' and 'completion', "
                         f"got {_type_name(obj)}")
    if "text" in obj and (obj["text"] is not None or not {"prompt", "completion"} <= set(obj)):
        text = obj["text"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string, got {_type_name(text)}")
        if not text.strip():
            raise ValueError(f"{where}: 'text' is empty ({text!r}): nothing to train on")
        return Example(text, source=where)
    if "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise ValueError(f"{where}: {name!r} must be a string, got {_type_name(value)}")
        if not completion:
            raise ValueError(f"{where}: 'completion' is empty: nothing to train on")
        return Example(completion, prompt, source=where)
    raise ValueError(f"{where}: expected a 'text' field, or 'prompt' and 'completion' (found {sorted(map(str, obj))})")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_encoding(encoding: str) -> str:
    """`encoding` if Python knows it as a text encoding, else ValueError naming the config key."""
    try:
        info = codecs.lookup(encoding)
    except (LookupError, TypeError, ValueError):
        raise ValueError(f"config key 'encoding': unknown text encoding {encoding!r} (e.g. 'utf-8', 'latin-1', "
                         "'cp1252')") from None
    if not getattr(info, "_is_text_encoding", True):
        raise ValueError(f"config key 'encoding': {encoding!r} is not a text encoding")
    return encoding


def read_text_file(path: Path, encoding: str = "utf-8") -> str:
    """The text of a user's ``.txt`` file, decoded strictly as `encoding` (UTF-8: a leading BOM
    dropped). Never guessed from the file's content (no coding comment is honoured); bytes that do
    not decode are refused, naming the file and the byte offset."""
    check_encoding(encoding)
    data = Path(path).read_bytes()
    utf8 = codecs.lookup(encoding).name == "utf-8"
    try:
        return data.decode("utf-8-sig" if utf8 else encoding)
    except UnicodeDecodeError as exc:
        offset = exc.start + (3 if utf8 and data.startswith(b"\xef\xbb\xbf") else 0)
        raise ValueError(f"data file {path}: not valid {encoding} text at byte {offset} "
                         f"({exc.reason}: {data[offset:offset + 4]!r}); give the file's encoding with the config "
                         "key 'encoding', or convert it") from None


def _jsonl_examples(path: Path) -> Iterator[Example]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"data file {path} line {number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: not valid UTF-8 ({exc})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from None
            except RecursionError:
                raise ValueError(f"{where}: JSON nested too deeply (an example is an object with 'text', or "
                                 "'prompt' and 'completion')") from None
            yield _example(obj, where)


def _parquet_examples(path: Path) -> Iterator[Example]:
    try:  # pyarrow is optional (slidedp[parquet])
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading the parquet file {path} needs the package 'pyarrow': "
                          "pip install pyarrow") from None
    try:
        f = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"data file {path}: not a readable parquet file ({' '.join(str(exc).split())})") from None
    names = set(f.schema_arrow.names)
    if "text" in names:
        columns = ["text"]
    elif {"prompt", "completion"} <= names:
        columns = ["prompt", "completion"]
    else:
        raise ValueError(f"data file {path}: expected a 'text' column, or 'prompt' and 'completion' "
                         f"(found {sorted(names)})")
    row = 0
    for batch in f.iter_batches(columns=columns, batch_size=1024):
        values = {c: batch.column(c).to_pylist() for c in columns}
        for i in range(batch.num_rows):
            yield _example({c: values[c][i] for c in columns}, f"data file {path} row {row}")
            row += 1


def iter_examples(files: list[Path], encoding: str = "utf-8") -> Iterator[Example]:
    """Examples of every file, in order, read lazily; a file without any example is refused.
    `encoding`: that of the ``.txt`` files (JSONL is UTF-8)."""
    for path in files:
        count = 0
        if path.suffix == ".txt":
            text = read_text_file(path, encoding)
            if text.strip():
                count += 1
                yield Example(text, source=f"data file {path}")
        elif path.suffix == ".jsonl":
            for example in _jsonl_examples(path):
                count += 1
                yield example
        elif path.suffix == ".parquet":
            for example in _parquet_examples(path):
                count += 1
                yield example
        else:
            raise ValueError(f"data file {path}: not a {', '.join(SUFFIXES)} file")
        if count == 0:
            raise ValueError(f"data file {path} is empty: it holds no example "
                             f"({'only whitespace' if path.suffix == '.txt' else 'no line with data'}); "
                             "remove it or fill it")


def tokenize_example(example: Example, tokenizer: Any, eos: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of an example, EOS appended; prompt tokens are labelled -100."""
    prompt = _encode(tokenizer, example.prompt) if example.prompt else []
    body = _encode(tokenizer, example.text) + [eos]
    return prompt + body, [-100] * len(prompt) + body


def build_rows(examples: Iterator[Example], tokenizer: Any, seq_len: int, *, packing: bool,
               max_rows: int | None = None) -> dict[str, torch.Tensor | None]:
    """``{"input_ids", "labels", "attention_mask"}`` rows ``[n, seq_len]``; ``labels`` is None when
    every token is trained (labels = input ids), ``attention_mask`` None when packing."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    eos = _resolve_eos(tokenizer, None)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = eos if pad is None else int(pad)
    ids_rows: list[list[int]] = []
    label_rows: list[list[int]] = []
    masks: list[list[int]] = []
    any_prompt = False

    def emit(ids: list[int], labels: list[int], mask: list[int] | None) -> bool:
        if any(v != -100 for v in labels[1:]):  # a row must train at least one token
            ids_rows.append(ids)
            label_rows.append(labels)
            if mask is not None:
                masks.append(mask)
        return max_rows is not None and len(ids_rows) >= max_rows

    if max_rows is not None and max_rows <= 0:
        examples = iter(())
    buf_ids: list[int] = []
    buf_labels: list[int] = []
    for example in examples:
        any_prompt |= example.prompt is not None
        ids, labels = tokenize_example(example, tokenizer, eos)
        where = example.source or "an example"
        if len(ids) < 2:
            raise ValueError(f"{where}: gives {len(ids)} token(s) with EOS; a next-token loss needs at least 2")
        if not packing:
            ids, labels = ids[:seq_len], labels[:seq_len]
            if example.source and not any(v != -100 for v in labels[1:]):
                raise ValueError(f"{where}: the prompt fills the whole row of seq_len={seq_len} tokens, so no "
                                 "completion token is trained (all labels -100); raise seq_len, shorten the "
                                 "prompt, or use packing=true")
            fill = seq_len - len(ids)
            if emit(ids + [pad] * fill, labels + [-100] * fill, [1] * len(ids) + [0] * fill):
                break
            continue
        buf_ids.extend(ids)
        buf_labels.extend(labels)
        done = False
        n_full = len(buf_ids) // seq_len
        for i in range(n_full):
            if emit(buf_ids[i * seq_len : (i + 1) * seq_len], buf_labels[i * seq_len : (i + 1) * seq_len], None):
                done = True
                break
        del buf_ids[: n_full * seq_len], buf_labels[: n_full * seq_len]
        if done:
            break

    def tensor(rows):
        return torch.tensor(rows, dtype=torch.long) if rows else torch.empty((0, seq_len), dtype=torch.long)

    return {
        "input_ids": tensor(ids_rows),
        "labels": tensor(label_rows) if (any_prompt or not packing) else None,
        "attention_mask": None if packing else tensor(masks),
    }


def load_dataset(spec: str, tokenizer: Any, seq_len: int, *, packing: bool = True, max_rows: int | None = None,
                 seed: int = 0, encoding: str = "utf-8") -> PackedDataset:
    """A ``PackedDataset`` (with labels and masks where needed) from the files named by ``spec``
    (``.txt`` files decoded as `encoding`)."""
    files = find_data_files(spec)
    rows = build_rows(iter_examples(files, encoding), tokenizer, seq_len, packing=packing, max_rows=max_rows)
    if rows["input_ids"].shape[0] == 0:
        raise ValueError(f"config key 'data': {spec} gives no row of {seq_len} tokens with a trained label "
                         f"({'packing' if packing else 'padding'}; rows whose labels are all -100 are dropped); "
                         "add data or lower seq_len")
    return PackedDataset(rows["input_ids"], seed=seed, labels=rows["labels"], attention_mask=rows["attention_mask"])


__all__ = ["Example", "SUFFIXES", "build_rows", "check_encoding", "find_data_files", "iter_examples", "load_dataset",
           "read_text_file", "tokenize_example"]
