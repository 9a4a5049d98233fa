"""Data side of the default job: stdlib documents, packing, PackedDataset resume/split."""

import json
import pathlib
import sysconfig

import pytest
import torch

from slidedp.train.data import (
    PackedDataset,
    TokenStream,
    pack_sequences,
    read_document,
    stdlib_dataset,
    stdlib_source_files,
)

EOS = 1


class ByteTokenizer:
    """Minimal tokenizer with the Hugging Face call convention: one token per UTF-8 byte."""

    eos_token_id = EOS

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 259

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        self.calls += 1
        return {"input_ids": [b + 3 for b in text.encode("utf-8")]}


def expected_stream(texts, eos=EOS):
    out = []
    for t in texts:
        if t.strip():
            out.extend(b + 3 for b in t.encode("utf-8"))
            out.append(eos)
    return out


TEXTS = ["alpha beta\n", "gamma", "", "  \n", "delta epsilon zeta eta\n" * 3, "θ-theta"]


# -------------------------------------------------------------------------- stdlib documents


def test_stdlib_files_nonempty_and_code_like():
    files = stdlib_source_files()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 200
    rel = [f.relative_to(root) for f in files]
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    for r in rel:
        assert not {"site-packages", "dist-packages", "test", "tests", "idlelib"} & set(r.parts[:-1]), r
    names = {r.as_posix() for r in rel}
    assert {"os.py", "json/__init__.py", "collections/__init__.py"} <= names
    assert files == sorted(files, key=lambda f: f.relative_to(root).parts)
    assert files == stdlib_source_files()  # deterministic


def test_read_document_text_and_path(tmp_path):
    p = tmp_path / "m.py"
    p.write_bytes("# -*- coding: latin-1 -*-\nx = '\xe9'\n".encode("latin-1"))
    assert read_document(p) == "# -*- coding: latin-1 -*-\nx = '\xe9'\n"
    assert read_document("just text") == "just text"
    with pytest.raises(TypeError):
        read_document(b"bytes")


# -------------------------------------------------------------------------- packing


@pytest.mark.parametrize("seq_len", [1, 4, 7, 16])
def test_pack_exact_rows_and_eos(seq_len):
    tok = ByteTokenizer()
    rows = pack_sequences(TEXTS, tok, seq_len)
    stream = expected_stream(TEXTS)
    n = len(stream) // seq_len
    assert rows.dtype == torch.long and rows.shape == (n, seq_len)
    assert rows.flatten().tolist() == stream[: n * seq_len]
    # one EOS after each non-empty document, nowhere else (no byte maps to id 1)
    assert (rows == EOS).sum().item() == stream[: n * seq_len].count(EOS)


def test_eos_at_document_boundaries():
    tok = ByteTokenizer()
    docs = ["aaaa", "bbbbbbb", "cc"]
    rows = pack_sequences(docs, tok, 5)  # 5 + 8 + 3 = 16 tokens -> 3 rows
    flat = rows.flatten().tolist()
    assert rows.shape == (3, 5)
    assert [i for i, t in enumerate(flat) if t == EOS] == [4, 12]
    assert flat[:4] == [ord("a") + 3] * 4
    assert flat[5:12] == [ord("b") + 3] * 7


def test_pack_explicit_eos_and_empty_result():
    tok = ByteTokenizer()
    rows = pack_sequences(["ab", "cd"], tok, 3, eos_token_id=0)
    assert rows.tolist() == [[ord("a") + 3, ord("b") + 3, 0], [ord("c") + 3, ord("d") + 3, 0]]
    empty = pack_sequences(["ab"], tok, 100)
    assert empty.shape == (0, 100) and empty.dtype == torch.long
    with pytest.raises(ValueError):
        pack_sequences(["ab"], tok, 0)


def test_pack_files_deterministic_and_lazy(tmp_path):
    files = []
    for i in range(50):
        p = tmp_path / f"f{i:02d}.py"
        p.write_text(f"# file {i}\n" + "x = 1\n" * (i + 1))
        files.append(p)
    tok = ByteTokenizer()
    a = pack_sequences(files, tok, 32, max_rows=5)
    assert tok.calls < 10  # stopped after filling 5 rows
    b = pack_sequences(files, ByteTokenizer(), 32, max_rows=5)
    assert a.shape == (5, 32) and torch.equal(a, b)
    full = pack_sequences(files, ByteTokenizer(), 32)
    assert torch.equal(full[:5], a)
    assert full.flatten().tolist() == expected_stream([p.read_text() for p in files])[: full.numel()]


def test_max_docs_and_stream_counters():
    tok = ByteTokenizer()
    s = TokenStream(TEXTS, tok, max_docs=2)
    docs = list(s.documents())
    assert docs == [expected_stream(TEXTS[:1]), expected_stream(TEXTS[1:2])]
    assert s.docs_read == 2 and s.tokens_read == sum(map(len, docs))
    rows = pack_sequences(TEXTS, ByteTokenizer(), 4, max_docs=2)
    assert rows.flatten().tolist() == expected_stream(TEXTS[:2])[: rows.numel()]


def test_generator_input_is_streamed():
    read = []

    def gen():
        for i in range(1000):
            read.append(i)
            yield "word " * 20

    rows = pack_sequences(gen(), ByteTokenizer(), 50, max_rows=3)
    assert rows.shape == (3, 50)
    assert len(read) <= 3


def test_stdlib_packing_reads_only_what_is_needed():
    files = stdlib_source_files()
    tok = ByteTokenizer()
    s = TokenStream(files, tok)
    rows = list(s.rows(128, max_rows=20))
    assert len(rows) == 20 and all(len(r) == 128 for r in rows)
    assert s.docs_read < 10 < len(files)
    a = pack_sequences(files, ByteTokenizer(), 128, max_rows=20)
    assert torch.equal(a, torch.tensor(rows))


def test_pack_cache_roundtrip(tmp_path):
    cache = tmp_path / "cache" / "rows.safetensors"
    tok = ByteTokenizer()
    a = pack_sequences(TEXTS, tok, 4, cache_path=cache)
    assert cache.is_file()
    calls = tok.calls
    b = pack_sequences(TEXTS, tok, 4, cache_path=cache)
    assert torch.equal(a, b)
    assert tok.calls == calls + 1  # only the tokenizer probe, no document tokenized
    c = pack_sequences(TEXTS, tok, 5, cache_path=cache)  # different key: recomputed
    assert c.shape[1] == 5 and tok.calls > calls + 2
    d = pack_sequences(TEXTS + ["more text here"], tok, 5, cache_path=cache)
    assert d.shape[0] > c.shape[0]
    assert not list(cache.parent.glob(".*tmp*"))


def test_real_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    files = stdlib_source_files()[:40]
    texts = [read_document(f) for f in files]
    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    eos = tok.eos_token_id
    rows = pack_sequences(files, tok, 64, max_rows=30)
    assert rows.shape == (30, 64)
    first = next(t for t in texts if t.strip())
    n_first = len(tok(first, add_special_tokens=False)["input_ids"])
    flat = rows.flatten()
    if n_first < flat.numel():
        assert flat[n_first].item() == eos
        assert tok.decode(flat[:n_first].tolist()) == first
    assert torch.equal(rows, pack_sequences(files, tok, 64, max_rows=30))


# -------------------------------------------------------------------------- PackedDataset


def make_rows(n=10, seq_len=6):
    return torch.arange(n * seq_len, dtype=torch.long).view(n, seq_len)


def row_ids(batch, seq_len=6):
    return (batch[:, 0] // seq_len).tolist()


def test_next_batch_covers_each_epoch_once():
    ds = PackedDataset(make_rows(10), seed=3)
    seen = [i for _ in range(5) for i in row_ids(ds.next_batch(4))]  # 20 rows = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # reshuffled
    assert seen[:10] != list(range(10))  # shuffled at all
    assert (ds.epoch, ds.position) == (2, 0)
    b = ds.next_batch(25)  # larger than the dataset: spans epochs
    assert b.shape == (25, 6)
    assert (ds.epoch, ds.position) == (4, 5)


def test_shuffle_deterministic_and_seeded():
    def seq(seed, shuffle=True):
        ds = PackedDataset(make_rows(10), seed=seed, shuffle=shuffle)
        return [row_ids(ds.next_batch(3)) for _ in range(8)]

    assert seq(0) == seq(0)
    assert seq(0) != seq(1)
    flat = [i for b in seq(0, shuffle=False) for i in b]
    assert flat == [i % 10 for i in range(24)]


@pytest.mark.parametrize("stop", [0, 1, 3, 4, 7])
def test_resume_roundtrip(stop):
    rows = make_rows(10)
    ref = PackedDataset(rows, seed=11)
    ref_batches = [ref.next_batch(3) for _ in range(12)]

    a = PackedDataset(rows, seed=11)
    for _ in range(stop):
        a.next_batch(3)
    state = json.loads(json.dumps(a.state_dict()))
    b = PackedDataset(rows.clone(), seed=999)  # seed comes from the state
    b.load_state_dict(state)
    for i in range(stop, 12):
        assert torch.equal(b.next_batch(3), ref_batches[i])


def test_load_state_rejects_other_data():
    a = PackedDataset(make_rows(10))
    state = a.state_dict()
    other = make_rows(10)
    other[3, 2] = -1
    with pytest.raises(ValueError):
        PackedDataset(other).load_state_dict(state)
    with pytest.raises(ValueError):
        PackedDataset(make_rows(11)).load_state_dict(state)
    with pytest.raises(ValueError):
        PackedDataset(make_rows(10)).load_state_dict({**state, "version": 99})


def test_split():
    ds = PackedDataset(make_rows(20), seed=5)
    train, val = ds.split(0.2)
    t_ids, v_ids = row_ids(train.rows), row_ids(val.rows)
    assert len(val) == 4 and len(train) == 16
    assert sorted(t_ids + v_ids) == list(range(20))
    assert t_ids == sorted(t_ids) and v_ids == sorted(v_ids)
    train2, val2 = ds.split(0.2)
    assert torch.equal(val.rows, val2.rows) and torch.equal(train.rows, train2.rows)
    assert not torch.equal(ds.split(0.2, seed=6)[1].rows, val.rows)
    assert len(PackedDataset(make_rows(3)).split(0.01)[1]) == 1
    assert len(ds.split(0.0)[1]) == 0
    assert [b.shape[0] for b in val.batches(3)] == [3, 1]
    assert [b.shape[0] for b in val.batches(3, drop_last=True)] == [3]
    assert (val.epoch, val.position) == (0, 0)
    with pytest.raises(ValueError):
        ds.split(1.0)


def test_dataset_validation():
    with pytest.raises(ValueError):
        PackedDataset(torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError):
        PackedDataset(torch.zeros(4, 4))
    with pytest.raises(ValueError):
        PackedDataset(torch.zeros(0, 4, dtype=torch.long)).next_batch(1)


def test_stdlib_dataset_with_cache(tmp_path):
    cache = tmp_path / "rows.safetensors"
    ds = stdlib_dataset(ByteTokenizer(), 256, max_rows=16, seed=1, cache_path=cache)
    assert len(ds) == 16 and ds.seq_len == 256
    ds2 = stdlib_dataset(ByteTokenizer(), 256, max_rows=16, seed=1, cache_path=cache)
    assert ds.fingerprint() == ds2.fingerprint()
    assert torch.equal(ds.next_batch(4), ds2.next_batch(4))
