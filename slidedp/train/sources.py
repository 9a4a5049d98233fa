"""A user's training data: ``.txt``, ``.jsonl`` and ``.parquet`` files or folders, as token rows.

Formats (an *example* is a text, every token trained, or a prompt and a completion, where the
prompt's tokens get label -100 so that only the completion is trained):

- ``.txt``: each file is one text, decoded strictly as ``encoding`` (config key, default UTF-8; a
  leading UTF-8 BOM is dropped); undecodable bytes are refused, naming the file and the byte offset.
- ``.jsonl``: one JSON object a line, with a ``text`` field, or ``prompt`` and ``completion``;
  blank lines are skipped.
- ``.parquet``: a ``text`` column, or ``prompt`` and ``completion`` columns (needs ``pyarrow``,
  imported only when a parquet file is read).
- chat, in ``.jsonl`` or ``.parquet``: ``{"messages": [{"role": "system"|"user"|"assistant",
  "content": "..."}, ...]}``, or the ShareGPT shape ``{"conversations": [{"from": "human"|"gpt"|
  "system", "value": "..."}, ...]}`` (human -> user, gpt -> assistant). A conversation is rendered
  by the tokenizer's chat template (or the config key ``chat_template``) and only the assistant
  turns are trained: their content and the template's end-of-turn token; the role headers, the
  system and user turns get -100 (`tokenize_chat`). No EOS is appended: the template ends the turn.
  A template whose rendering is not prefix-stable is refused, as are a conversation with no
  assistant turn, an unknown role and a content that is not a string.

``data`` names files and folders, comma-separated; a folder contributes every file of these
kinds below it, in sorted order (a folder written by `datasets`' ``save_to_disk`` is one source).
`loading.load_dataset` reads them through Hugging Face `datasets` and its Arrow cache (arrowdata.py)
when it is installed, else with the reader of this module (`read_plain_dataset`): examples read lazily (`iter_examples`), reading
stopped once ``max_rows`` rows are filled (`build_rows`); both give the same rows.

Two ways to make rows of exactly ``seq_len`` tokens:

- packing (``packing=True``): each example's tokens, then EOS, are concatenated and cut into
  rows (the incomplete tail is dropped). No attention mask: examples in a row see each other,
  as in the usual packed training. For plain texts this gives exactly the rows of
  ``data.pack_sequences``.
- padding (``packing=False``): one example a row, truncated to ``seq_len`` (its first ``seq_len``
  tokens: a conversation loses its last turns, labels cut at the same place), EOS appended if it
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
import importlib.util
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
    text: str  # the text, or the completion ("" for a conversation)
    prompt: str | None = None  # None: a plain text, every token trained
    source: str = field(default="", compare=False)  # "data file F line N": where it came from, for errors
    # a conversation: ((role, content), ...), roles system/user/assistant; only assistant turns are trained
    messages: tuple[tuple[str, str], ...] | None = None


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `datasets`' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def find_data_files(spec: str, key: str = "data") -> list[Path]:
    """The files named by ``spec`` (comma-separated files and folders), folders expanded (a
    ``save_to_disk`` folder is one source, kept whole); errors name the config key `key`. Reads no
    data: `slidedp train` calls it before loading the model."""
    files: list[Path] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        path = Path(part).expanduser()
        if is_saved_dataset(path):
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise FileNotFoundError(f"config key {key!r}: folder {part} holds no {', '.join(SUFFIXES)} files "
                                        "and is not a save_to_disk folder")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"config key {key!r}: {part} is not a {', '.join(SUFFIXES)} file")
            files.append(path)
        else:
            raise FileNotFoundError(f"config key {key!r}: {part} does not exist")
    if not files:
        raise FileNotFoundError(f"config key {key!r}: no data files in {spec!r}")
    return files


CHAT_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def _conversation(obj: dict, where: str) -> Example:
    """An `Example` of ``{"messages": [{"role", "content"}, ...]}`` or of the ShareGPT shape
    ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``."""
    name = "messages" if "messages" in obj else "conversations"
    turns = obj[name]
    role_key, content_key = ("role", "content") if name == "messages" else ("from", "value")
    roles = {r: r for r in CHAT_ROLES} if name == "messages" else SHAREGPT_ROLES
    if not isinstance(turns, list):
        raise ValueError(f"{where}: {name!r} must be a list of turns, got {_type_name(turns)}")
    if not turns:
        raise ValueError(f"{where}: {name!r} is empty: nothing to train on")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: {name}[{i}] must be an object with {role_key!r} and {content_key!r}, "
                             f"got {_type_name(turn)}")
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or role not in roles:
            raise ValueError(f"{where}: {name}[{i}] has the role {role_key}={role!r}; known roles: "
                             f"{', '.join(roles)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: {name}[{i}] {content_key!r} must be a string, got {_type_name(content)}")
        out.append((roles[role], content))
    if not any(role == "assistant" for role, _ in out):
        raise ValueError(f"{where}: the conversation has no assistant turn: nothing to train on (only assistant "
                         "turns are trained)")
    if not any(content.strip() for role, content in out if role == "assistant"):
        raise ValueError(f"{where}: every assistant turn is empty: nothing to train on")
    return Example("", source=where, messages=tuple(out))


def _example(obj: Any, where: str) -> Example:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with 'text', or 'prompt' and 'completion', or 'messages' "
                         f"(or 'conversations'), got {_type_name(obj)}")
    if obj.get("messages") is not None or obj.get("conversations") is not None:
        return _conversation(obj, where)
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
    raise ValueError(f"{where}: expected a 'text' field, or 'prompt' and 'completion', or 'messages' (or "
                     f"'conversations') (found {sorted(map(str, obj))})")


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
    if "messages" in names:
        columns = ["messages"]
    elif "conversations" in names:
        columns = ["conversations"]
    elif "text" in names:
        columns = ["text"]
    elif {"prompt", "completion"} <= names:
        columns = ["prompt", "completion"]
    else:
        raise ValueError(f"data file {path}: expected a 'text' column, or 'prompt' and 'completion', or "
                         f"'messages' (or 'conversations') (found {sorted(names)})")
    row = 0
    for batch in f.iter_batches(columns=columns, batch_size=1024):
        values = {c: batch.column(c).to_pylist() for c in columns}
        for i in range(batch.num_rows):
            yield _example({c: values[c][i] for c in columns}, f"data file {path} row {row}")
            row += 1


def iter_examples(files: list[Path], encoding: str = "utf-8") -> Iterator[Example]:
    """Examples of every file, in order, read lazily; a file without any example is refused.
    `encoding`: that of the ``.txt`` files (JSONL is UTF-8). A ``save_to_disk`` folder needs `datasets`."""
    for path in files:
        count = 0
        if path.is_dir():  # a save_to_disk folder: read by arrowdata.py (loading.load_dataset) only
            raise ImportError(f"reading the save_to_disk folder {path} needs the package 'datasets' "
                              "(pip install 'datasets>=4.3'), through slidedp.train.loading.load_dataset")
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


def chat_template_text(value: str) -> str:
    """The Jinja text of the config key ``chat_template``: the file's text when `value` names a file
    (a ``.jinja`` file must exist), else `value` itself, which must then look like a Jinja template."""
    path = Path(value).expanduser()
    if "\n" not in value and len(value) < 4096 and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"config key 'chat_template': cannot read {value} as UTF-8 text ({exc})") from None
    if value.strip().endswith(".jinja"):
        raise FileNotFoundError(f"config key 'chat_template': the file {value} does not exist")
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"config key 'chat_template': {value!r:.80} is neither a file nor a Jinja template "
                         "(no '{{' or '{%')")
    return value


def set_chat_template(tokenizer: Any, value: str) -> None:
    """Give `tokenizer` the chat template of the config key ``chat_template`` (a Jinja string or a
    file), so that chat data, checkpoints and exports use it; "" leaves the tokenizer's own."""
    if value:
        tokenizer.chat_template = chat_template_text(value)


def _render(tokenizer: Any, messages: list[dict], generation: bool, where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as exc:  # jinja2 errors, raise_exception() in a template, ...
        raise ValueError(f"{where}: the chat template failed on this conversation ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())})") from None
    if not isinstance(text, str):
        raise ValueError(f"{where}: the chat template rendered {_type_name(text)}, not text")
    return text


def tokenize_chat(messages: tuple[tuple[str, str], ...], tokenizer: Any, where: str = "a conversation"
                  ) -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversation rendered by the tokenizer's chat template; only the assistant
    turns are trained (their content and the template's end of turn), every other token -100.

    An assistant turn i spans the characters from the end of ``messages[:i]`` rendered with the
    generation prompt to the end of ``messages[:i+1]``; both renderings must be prefixes of the whole
    conversation, else the template is refused (not prefix-stable). The conversation is tokenized
    once; the tokens that overlap a turn's characters are trained (by the tokenizer's offsets; a slow
    tokenizer without offsets needs the prefixes to be token prefixes too). Whitespace tokens that
    follow a special token at the end of a turn (the newline after ``<|im_end|>``) are not trained."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: a conversation needs a chat template and the tokenizer has none; set the "
                         "config key 'chat_template' to a Jinja template or a .jinja file")
    turns = [{"role": role, "content": content} for role, content in messages]
    full_text = _render(tokenizer, turns, False, where)
    spans = []  # (start, end) characters of each assistant turn in full_text
    for i, (role, _) in enumerate(messages):
        if role != "assistant":
            continue
        before = _render(tokenizer, turns[:i], True, where) if i else _render_empty(tokenizer, where)
        upto = _render(tokenizer, turns[: i + 1], False, where)
        if not (upto.startswith(before) and full_text.startswith(upto)):
            raise ValueError(f"{where}: the chat template is not prefix-stable (the rendering of the turns up to "
                             f"assistant turn {i} is not a prefix of the whole conversation), so the assistant "
                             "tokens cannot be located; use a template whose rendering only appends turns "
                             "(config key 'chat_template')")
        spans.append((len(before), len(upto)))
    try:
        enc = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer: no offsets
        ids, offsets = _encode(tokenizer, full_text), None
    labels = [-100] * len(ids)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for a, b in spans:
        if offsets is not None:  # the tokens that overlap the turn's characters
            inside = [k for k, (s0, s1) in enumerate(offsets) if s1 > a and s0 < b]
            if not inside:
                continue
            start, end = inside[0], inside[-1] + 1
        else:  # the turn's token prefixes must be prefixes of the conversation's tokens
            head, upto = _encode(tokenizer, full_text[:a]), _encode(tokenizer, full_text[:b])
            if ids[: len(upto)] != upto or ids[: len(head)] != head:
                raise ValueError(f"{where}: the chat template is not prefix-stable as tokens (a token of an "
                                 "assistant turn merges with its neighbour), so the assistant tokens cannot be "
                                 "located; change the template (config key 'chat_template') so that a special "
                                 "token or a line break separates the turns")
            start, end = len(head), len(upto)
        while end - 1 > start and ids[end - 2] in special and not tokenizer.decode([ids[end - 1]]).strip():
            end -= 1
        labels[start:end] = ids[start:end]
    return ids, labels


def _render_empty(tokenizer: Any, where: str) -> str:
    """The generation prompt before a first assistant turn ("" when the template cannot render no turn)."""
    try:
        return _render(tokenizer, [], True, where)
    except ValueError:
        return ""


def tokenize_example(example: Example, tokenizer: Any, eos: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of an example, EOS appended; prompt tokens are labelled -100. A conversation is
    rendered by the chat template (`tokenize_chat`), with no EOS of its own."""
    if example.messages is not None:
        return tokenize_chat(example.messages, tokenizer, example.source or "a conversation")
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
        any_prompt |= example.prompt is not None or example.messages is not None
        ids, labels = tokenize_example(example, tokenizer, eos)
        where = example.source or "an example"
        if len(ids) < 2:
            raise ValueError(f"{where}: gives {len(ids)} token(s) with EOS; a next-token loss needs at least 2")
        if not packing:
            ids, labels = ids[:seq_len], labels[:seq_len]
            if example.source and not any(v != -100 for v in labels[1:]):
                what = "the turns before the first assistant reply fill" if example.messages else "the prompt fills"
                raise ValueError(f"{where}: {what} the whole row of seq_len={seq_len} tokens, so no "
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


def have_datasets() -> bool:
    """Whether Hugging Face `datasets` can be imported."""
    return importlib.util.find_spec("datasets") is not None


def read_plain_dataset(spec: str, tokenizer: Any, seq_len: int, *, packing: bool = True, max_rows: int | None = None,
                       seed: int = 0, encoding: str = "utf-8", chat_template: str = "", key: str = "data"
                       ) -> PackedDataset:
    """A ``PackedDataset`` of the files named by ``spec`` through this module's reader alone (no
    `datasets`, no cache; a ``save_to_disk`` folder is refused): the rows of `loading.load_dataset`."""
    set_chat_template(tokenizer, chat_template)
    files = find_data_files(spec, key)
    rows = build_rows(iter_examples(files, encoding), tokenizer, seq_len, packing=packing, max_rows=max_rows)
    return packed_dataset(rows, spec=spec, key=key, seq_len=seq_len, packing=packing, seed=seed)


def packed_dataset(rows: dict, *, spec: str, key: str, seq_len: int, packing: bool, seed: int) -> PackedDataset:
    """The ``PackedDataset`` of `rows` (``build_rows``' dict); no row at all is refused naming the key."""
    if rows["input_ids"].shape[0] == 0:
        raise ValueError(f"config key {key!r}: {spec} gives no row of {seq_len} tokens with a trained label "
                         f"({'packing' if packing else 'padding'}; rows whose labels are all -100 are dropped); "
                         "add data or lower seq_len")
    return PackedDataset(rows["input_ids"], seed=seed, labels=rows["labels"], attention_mask=rows["attention_mask"])


__all__ = ["CHAT_ROLES", "Example", "SUFFIXES", "build_rows", "chat_template_text", "check_encoding",
           "find_data_files", "have_datasets", "is_saved_dataset", "iter_examples", "packed_dataset", "read_plain_dataset", "read_text_file",
           "set_chat_template", "tokenize_chat", "tokenize_example"]
