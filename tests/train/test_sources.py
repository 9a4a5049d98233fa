"""A user's data: .txt / .jsonl / .parquet files and folders, packing and padding, prompt masking."""

import json
import sys

import pytest
import torch

from slidedp.train.data import PackedDataset, pack_sequences
from slidedp.train.loading import load_dataset
from slidedp.train.sources import Example, build_rows, find_data_files, iter_examples

EOS, PAD = 1, 2


class ByteTokenizer:
    """One token per UTF-8 byte (ids 3..258), EOS 1, PAD 2, Hugging Face call convention."""

    eos_token_id = EOS
    pad_token_id = PAD

    def __len__(self):
        return 259

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [b + 3 for b in text.encode("utf-8")]}


def ids(text):
    return [b + 3 for b in text.encode("utf-8")]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_text_packing_matches_pack_sequences(tmp_path):
    texts = ["alpha beta\n", "gamma", "delta epsilon zeta\n" * 3]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t)
    write_jsonl(tmp_path / "more.jsonl", [{"text": t} for t in texts])
    rows = build_rows(iter_examples(find_data_files(str(tmp_path))), ByteTokenizer(), 7, packing=True)
    expected = pack_sequences(texts * 2, ByteTokenizer(), 7)  # the .txt files, then the .jsonl lines
    assert torch.equal(rows["input_ids"], expected)
    assert rows["labels"] is None and rows["attention_mask"] is None  # every token trained, no padding


def test_prompt_tokens_are_masked_when_packing(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q?", "completion": "A."}, {"prompt": "Hi", "completion": "yo"}])
    rows = build_rows(iter_examples([path]), ByteTokenizer(), 4, packing=True)
    stream = ids("Q?") + ids("A.") + [EOS] + ids("Hi") + ids("yo") + [EOS]  # 10 tokens: 2 rows of 4
    labels = [-100, -100] + ids("A.") + [EOS] + [-100, -100] + ids("yo") + [EOS]
    assert rows["input_ids"].flatten().tolist() == stream[:8]
    assert rows["labels"].flatten().tolist() == labels[:8]
    assert rows["attention_mask"] is None


def test_padding_gives_masks_and_ignored_labels(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "Q?", "completion": "A."},
        {"text": "abcdefghijk"},  # longer than a row: truncated, no EOS
    ])
    rows = build_rows(iter_examples([path]), ByteTokenizer(), 8, packing=False)
    assert rows["input_ids"].tolist() == [ids("Q?") + ids("A.") + [EOS] + [PAD] * 3, ids("abcdefgh")]
    assert rows["labels"].tolist() == [[-100, -100] + ids("A.") + [EOS] + [-100] * 3, ids("abcdefgh")]
    assert rows["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 8]


def test_max_rows_stops_reading(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * 10}] * 3 + ["not an object"])
    rows = build_rows(iter_examples([path]), ByteTokenizer(), 4, packing=True, max_rows=3)
    assert rows["input_ids"].shape == (3, 4)  # the bad last line is never read
    # load_dataset tokenizes every line into the Arrow cache (arrowdata.py), so it checks them all
    with pytest.raises(ValueError, match="t.jsonl line 4: expected an object"):
        load_dataset(str(path), ByteTokenizer(), 4, packing=False, max_rows=2, seed=3)
    path = write_jsonl(tmp_path / "good.jsonl", [{"text": "x" * 10}] * 3)
    ds = load_dataset(str(path), ByteTokenizer(), 4, packing=False, max_rows=2, seed=3)
    assert isinstance(ds, PackedDataset) and len(ds) == 2 and ds.attention_mask is not None


@pytest.mark.parametrize("line, words", [
    ('{"txt": "a"}', "line 2: expected a 'text' field"),
    ('[1, 2]', "line 2: expected an object"),
    ('{"text": 5}', "line 2: 'text' must be a string"),
    ('{"prompt": "a", "completion": 3}', "line 2: 'completion' must be a string, got int"),
    ('{"text": "a"', "line 2: not valid JSON"),
    ('{"text": "   "}', "line 2: 'text' is empty"),
    ('{"prompt": "a", "completion": ""}', "line 2: 'completion' is empty"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl {words}"):
        list(iter_examples([path]))


def test_find_data_files(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.txt", "d/sub/a.jsonl", "d/skip.csv", "c.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}')
    found = find_data_files(f"{tmp_path / 'd'}, {tmp_path / 'c.jsonl'}")
    assert found == [tmp_path / "d/b.txt", tmp_path / "d/sub/a.jsonl", tmp_path / "c.jsonl"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_data_files(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="is not a"):
        find_data_files(str(tmp_path / "d/skip.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no"):
        find_data_files(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="gives no row"):
        load_dataset(str(tmp_path / "c.jsonl"), ByteTokenizer(), 64)


def test_parquet_text_and_prompt_completion(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha", "beta gamma"], "other": [1, 2]}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"prompt": ["Q?", "Hi"], "completion": ["A.", "yo"]}), tmp_path / "pc.parquet")
    assert list(iter_examples([tmp_path / "t.parquet"])) == [Example("alpha"), Example("beta gamma")]
    assert list(iter_examples([tmp_path / "pc.parquet"])) == [Example("A.", "Q?"), Example("yo", "Hi")]
    write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q?", "completion": "A."}, {"prompt": "Hi", "completion": "yo"}])
    a = build_rows(iter_examples([tmp_path / "pc.parquet"]), ByteTokenizer(), 4, packing=True)
    b = build_rows(iter_examples([tmp_path / "pc.jsonl"]), ByteTokenizer(), 4, packing=True)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet: expected a 'text' column"):
        list(iter_examples([tmp_path / "bad.parquet"]))
    pq.write_table(pa.table({"text": ["alpha", ""]}), tmp_path / "empty-row.parquet")
    with pytest.raises(ValueError, match="empty-row.parquet row 1: 'text' is empty"):
        list(iter_examples([tmp_path / "empty-row.parquet"]))


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="needs the package 'pyarrow': pip install pyarrow"):
        list(iter_examples([path]))


def test_dataset_with_labels_and_masks_splits_and_resumes():
    n, s = 10, 6
    rows = torch.arange(n * s).view(n, s)
    labels = rows.clone()
    labels[:, :2] = -100
    mask = torch.ones_like(rows)
    mask[:, -1] = 0
    ds = PackedDataset(rows, seed=4, labels=labels, attention_mask=mask)
    b = ds.next_fields(3)
    assert torch.equal(b.labels, labels[b.input_ids[:, 0] // s])
    assert torch.equal(b.attention_mask, mask[b.input_ids[:, 0] // s])
    state = ds.state_dict()
    nxt = ds.next_fields(4)
    again = PackedDataset(rows, labels=labels, attention_mask=mask)
    again.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(again.next_fields(4), nxt))
    with pytest.raises(ValueError, match="different data"):  # the labels are part of the fingerprint
        PackedDataset(rows, labels=rows.clone(), attention_mask=mask).load_state_dict(state)
    train, val = ds.split(0.3)
    assert len(val) == 3 and val.labels is not None and train.attention_mask is not None
    for part in (train, val):
        assert torch.equal(part.labels, labels[part.rows[:, 0] // s])
    assert [b.input_ids.shape[0] for b in val.field_batches(2)] == [2, 1]
    with pytest.raises(ValueError, match="labels must be"):
        PackedDataset(rows, labels=labels[:, :3])
