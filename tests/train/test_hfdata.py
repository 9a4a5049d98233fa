"""Data through Hugging Face `datasets` (slidedp/train/arrowdata.py), schedules through
`transformers.get_scheduler` (schedule.py), and the data paths checked before the model loads."""

import json
import socket
import warnings

import pytest
import torch

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from slidedp.train import arrowdata, sources  # noqa: E402
from slidedp.train.arrowdata import is_cached, load_arrow_dataset  # noqa: E402
from slidedp.train.config import load_config  # noqa: E402
from slidedp.train.schedule import SCHEDULES, lr_at, schedule_index  # noqa: E402
from slidedp.train import loading  # noqa: E402
from slidedp.train.loading import load_dataset  # noqa: E402
from slidedp.train.sources import build_rows, find_data_files, iter_examples  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Question: what is two plus two?\nAnswer: four."]
PAIRS = [("Question: 1?\n", "Answer: 2.\n"), ("Q: 2?", "A: 4."),
         ("Hi", "yo")]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ':\n' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ '<eos>' }}{% endif %}{{ '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}")
CONVERSATION = [{"role": "user", "content": "Q: 2?"}, {"role": "assistant", "content": "A: 4."}]


@pytest.fixture
def tok():
    from conftest import make_tokenizer

    return make_tokenizer()


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def padded(tok, seq_len, examples):
    """Rows made by hand: (prompt ids + completion ids + EOS), cut to seq_len, padded; labels -100 on the prompt."""
    ids_rows, label_rows, masks = [], [], []
    for prompt, text in examples:
        p, body = (enc(tok, prompt) if prompt else []), enc(tok, text) + [tok.eos_token_id]
        ids, labels = (p + body)[:seq_len], ([-100] * len(p) + body)[:seq_len]
        fill = seq_len - len(ids)
        ids_rows.append(ids + [tok.pad_token_id] * fill)
        label_rows.append(labels + [-100] * fill)
        masks.append([1] * len(ids) + [0] * fill)
    return torch.tensor(ids_rows), torch.tensor(label_rows), torch.tensor(masks)


def test_each_format_gives_the_hand_tokenized_rows(tok, tmp_path):
    """.jsonl, .txt, .parquet and a save_to_disk folder: the rows of tokenizing by hand, padded and packed."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [{"text": t} for t in TEXTS])
    write_jsonl(data / "b.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    (data / "c.txt").write_text(TEXTS[0])
    pq.write_table(pa.table({"prompt": [p for p, _ in PAIRS], "completion": [c for _, c in PAIRS]}),
                   data / "d.parquet")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS[::-1]}).save_to_disk(str(saved))
    expected_examples = ([(None, t) for t in TEXTS] + list(PAIRS) + [(None, TEXTS[0])] + list(PAIRS)
                         + [(None, t) for t in TEXTS[::-1]])
    spec = f"{data},{saved}"
    assert find_data_files(spec) == [data / "a.jsonl", data / "b.jsonl", data / "c.txt", data / "d.parquet", saved]

    ds = load_dataset(spec, tok, 24, packing=False, cache_dir=tmp_path / "cache")
    ids, labels, mask = padded(tok, 24, expected_examples)
    assert torch.equal(ds.rows, ids) and torch.equal(ds.labels, labels) and torch.equal(ds.attention_mask, mask)

    packed = load_dataset(spec, tok, 16, packing=True, cache_dir=tmp_path / "cache")
    stream_ids, stream_labels = [], []
    for prompt, text in expected_examples:
        p, body = (enc(tok, prompt) if prompt else []), enc(tok, text) + [tok.eos_token_id]
        stream_ids += p + body
        stream_labels += [-100] * len(p) + body
    n = len(stream_ids) // 16
    rows, row_labels = torch.tensor(stream_ids[: n * 16]).view(n, 16), torch.tensor(stream_labels[: n * 16]).view(n, 16)
    keep = (row_labels[:, 1:] != -100).any(1)  # a row of prompt tokens only is dropped
    assert torch.equal(packed.rows, rows[keep]) and torch.equal(packed.labels, row_labels[keep])
    assert packed.attention_mask is None


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("max_rows", [None, 1, 3, 5])
def test_rows_equal_the_lazy_reader(tok, tmp_path, packing, max_rows):
    """The same rows as sources.build_rows over iter_examples, chat and parquet included, with max_rows
    (labels kept only when an example read so far has a prompt, as there)."""
    tok.chat_template = CHAT_TEMPLATE
    write_jsonl(tmp_path / "a.jsonl", [{"text": t * 3} for t in TEXTS])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    pq.write_table(pa.table({"messages": [CONVERSATION, CONVERSATION]}), tmp_path / "c.parquet")
    files = find_data_files(str(tmp_path))
    new = load_dataset(str(tmp_path), tok, 32, packing=packing, max_rows=max_rows, cache_dir=tmp_path / "cache")
    old = build_rows(iter_examples(files), tok, 32, packing=packing, max_rows=max_rows)
    for name, t in (("input_ids", new.rows), ("labels", new.labels), ("attention_mask", new.attention_mask)):
        assert (t is None) == (old[name] is None), name
        assert t is None or torch.equal(t, old[name]), name


def test_second_load_reads_the_cache_without_tokenizing(tok, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS * 4])
    cache = tmp_path / "cache"
    calls = []
    real = arrowdata.tokenize_example
    monkeypatch.setattr(arrowdata, "tokenize_example", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert not is_cached(path, tok, cache_dir=cache)
    first = load_dataset(str(path), tok, 16, packing=False, seed=3, cache_dir=cache)
    assert len(calls) == 12 and is_cached(path, tok, cache_dir=cache)
    second = load_dataset(str(path), tok, 16, packing=True, seed=3, cache_dir=cache)  # another seq_len use
    third = load_dataset(str(path), tok, 16, packing=False, seed=3, cache_dir=cache)
    assert len(calls) == 12  # read back from Arrow: not tokenized again
    assert len(second) > 0 and third.fingerprint() == first.fingerprint()
    assert [p.name for p in cache.iterdir()] == [arrowdata.source_key(path, arrowdata.tokenizer_key(tok), "utf-8")]

    other = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token="<pad>", pad_token="<pad>")
    assert not is_cached(path, other, cache_dir=cache)  # another EOS: another key
    write_jsonl(path, [{"prompt": p, "completion": c} for p, c in PAIRS * 5])  # the file changed
    assert not is_cached(path, tok, cache_dir=cache)
    assert len(load_dataset(str(path), tok, 16, packing=False, cache_dir=cache)) == 15 and len(calls) == 27


def test_resume_position_is_exact(tok, tmp_path):
    """A dataset loaded again (from the cache) continues exactly at a saved position; the lazy reader's
    rows have the same fingerprint, so older checkpoints fit."""
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": f"{i}: {t}"} for i in range(10) for t in TEXTS])
    a = load_dataset(str(path), tok, 12, seed=5, cache_dir=tmp_path / "cache")
    for _ in range(3):
        a.next_fields(7)
    state = a.state_dict()
    expected = [a.next_fields(7) for _ in range(4)]  # into the next epoch
    b = load_arrow_dataset(str(path), tok, 12, seed=5, cache_dir=tmp_path / "cache")
    b.load_state_dict(state)
    for x, y in zip(expected, (b.next_fields(7) for _ in range(4))):
        assert torch.equal(x.input_ids, y.input_ids)
    old = build_rows(iter_examples([path]), tok, 12, packing=True)
    assert torch.equal(old["input_ids"], b.rows) and state["fingerprint"] == b.fingerprint()


@pytest.mark.parametrize("line, words", [
    ('{"txt": "a"}', "line 3: expected a 'text' field"),
    ('{"text": 5}', "line 3: 'text' must be a string, got int"),
    ('{"text": "a"', "line 3: not valid JSON"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"line 3: messages\[0\] has the role role='robot'"),
])
def test_bad_line_names_file_and_line(tok, tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")  # a blank line counts
    with pytest.raises(ValueError, match=f"data file {path} {words}"):
        load_dataset(str(path), tok, 8, cache_dir=tmp_path / "cache")
    path.write_text('{"text": "fine"}\n\n{"text": "fixed"}\n')  # nothing half-written is read back
    assert load_dataset(str(path), tok, 4, packing=False, cache_dir=tmp_path / "cache").rows.shape == (2, 4)


def test_bad_txt_and_parquet_and_folder_are_named(tok, tmp_path):
    txt = tmp_path / "latin.txt"
    txt.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(ValueError, match=f"data file {txt}: not valid utf-8 text at byte 3"):
        load_dataset(str(txt), tok, 4, cache_dir=tmp_path / "cache")
    assert len(load_dataset(str(txt), tok, 4, encoding="latin-1", cache_dir=tmp_path / "cache")) > 0
    pq.write_table(pa.table({"text": ["alpha", "  "]}), tmp_path / "e.parquet")
    with pytest.raises(ValueError, match="e.parquet row 1: 'text' is empty"):
        load_dataset(str(tmp_path / "e.parquet"), tok, 4, cache_dir=tmp_path / "cache")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="junk.parquet: not a readable parquet file"):
        load_dataset(str(tmp_path / "junk.parquet"), tok, 4, cache_dir=tmp_path / "cache")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"body": ["x"]}),
                          "b": datasets.Dataset.from_dict({"body": ["y"]})}).save_to_disk(str(saved))
    with pytest.raises(ValueError, match="splits a, b and no 'train'"):
        load_dataset(str(saved), tok, 4, cache_dir=tmp_path / "cache")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["x"]})}).save_to_disk(str(saved))
    with pytest.raises(ValueError, match=f"data folder {saved}: expected a 'text' column"):
        load_dataset(str(saved), tok, 4, cache_dir=tmp_path / "cache")


def test_padding_error_names_the_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "Hi", "completion": "yo"},
                                                 {"prompt": TEXTS[0] * 3, "completion": "ok"}])
    with pytest.raises(ValueError, match="long.jsonl line 2: the prompt fills the whole row of seq_len=8"):
        load_dataset(str(path), tok, 8, packing=False, cache_dir=tmp_path / "cache")


def test_loading_never_opens_a_socket(tok, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "t.parquet")
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    ds = load_dataset(f"{tmp_path / 't.parquet'},{tmp_path / 'saved'}", tok, 8, cache_dir=tmp_path / "cache")
    assert len(ds) > 0


def test_without_datasets_the_lazy_reader_is_used_with_one_warning(tok, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    with_arrow = load_dataset(str(path), tok, 16, packing=False, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(loading, "have_datasets", lambda: False)
    monkeypatch.setattr(loading, "_warned_no_datasets", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = load_dataset(str(path), tok, 16, packing=False)
        load_dataset(str(path), tok, 16, packing=False)
    assert [str(w.message) for w in caught if "datasets" in str(w.message)] == [
        "the package 'datasets' is not installed: reading the data without its Arrow cache (every run tokenizes "
        "again); pip install 'datasets>=4.3'"]
    assert first.fingerprint() == with_arrow.fingerprint()
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ImportError, match="save_to_disk folder .*saved needs the package 'datasets'"):
        load_dataset(str(tmp_path / "saved"), tok, 16)


# --------------------------------------------------------------------------------------------
# Schedules


def hf_reference(name, lr, warmup, max_steps, **kwargs):
    """The rates a torch optimizer gets from `transformers.get_scheduler`, index 0..max_steps."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=max_steps,
                          scheduler_specific_kwargs=kwargs or None)
    rates = []
    for _ in range(max_steps + 1):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("schedule, min_lr, hf_name, extra", [
    ("constant", 0.0, "constant_with_warmup", {}),
    ("constant_with_warmup", 0.0, "constant_with_warmup", {}),
    ("linear", 0.0, "linear", {}),
    ("linear", 1e-4, "polynomial", {"lr_end": 1e-4, "power": 1.0}),
    ("cosine", 0.0, "cosine", {}),
    ("cosine", 1e-4, "cosine_with_min_lr", {"min_lr": 1e-4}),
    ("inverse_sqrt", 0.0, "inverse_sqrt", {}),
])
def test_schedule_is_transformers_get_scheduler(schedule, min_lr, hf_name, extra):
    lr, warmup, max_steps = 3e-3, 4, 20
    reference = hf_reference(hf_name, lr, warmup, max_steps, **extra)
    for step in (1, 2, 4, 5, 6, 11, 19, 20):
        got = lr_at(step, lr=lr, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr=min_lr)
        index = step if step <= warmup else step - 1  # no zero rate at step 1, full rate after the warm-up
        assert index == schedule_index(step, warmup, max_steps)
        assert got == reference[index], (step, got, reference[index])
    assert lr_at(1, lr=lr, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr=min_lr) == lr / 4
    assert lr_at(5, lr=lr, schedule=schedule, warmup_steps=warmup, max_steps=max_steps, min_lr=min_lr) == lr


def test_schedule_refuses_unknown_names_listing_the_valid_ones():
    with pytest.raises(ValueError, match="unknown lr_schedule 'step': one of " + ", ".join(SCHEDULES)):
        lr_at(1, lr=1.0, schedule="step")
    with pytest.raises(ValueError, match="'lr_schedule' must be constant, constant_with_warmup, linear, cosine or "
                                         "inverse_sqrt, got 'warmup_stable_decay'"):
        load_config(None, ["lr_schedule=warmup_stable_decay"])
    with pytest.raises(ValueError, match="inverse_sqrt schedule has no minimum rate"):
        load_config(None, ["lr_schedule=inverse_sqrt", "min_lr=1e-6"])


# --------------------------------------------------------------------------------------------
# Data paths before the model


@pytest.mark.parametrize("key, value, error, words", [
    ("data", "nope.jsonl", FileNotFoundError, "config key 'data': .*nope.jsonl does not exist"),
    ("val_data", "nope.jsonl", FileNotFoundError, "config key 'val_data': .*nope.jsonl does not exist"),
    ("data", "table.csv", ValueError, "config key 'data': .*table.csv is not a .txt, .jsonl, .parquet file"),
])
def test_data_paths_are_checked_before_the_model_loads(tiny_jsonl, tmp_path, monkeypatch, key, value, error, words):
    from slidedp.train import job

    def no_model(cfg):
        raise AssertionError("the model was loaded before the data paths were checked")

    monkeypatch.setattr(job, "load_model_and_tokenizer", no_model)
    (tmp_path / "table.csv").write_text("a,b\n")
    out = tmp_path / "run"
    overrides = [f"data={tiny_jsonl[0]}", f"output_dir={out}", "device=cpu", "progress=false",
                 f"{key}={tmp_path / value}"]
    with pytest.raises(error, match=words):
        job.run(load_config(None, overrides))
    assert not out.exists()  # nothing made either
    with pytest.raises(AssertionError, match="the model was loaded"):  # good paths: on to the model
        job.run(load_config(None, [f"data={tiny_jsonl[0]}", f"output_dir={out}", "device=cpu"]))
