"""Bad input gets one clear line naming the file, line, key or value (exit status 2), never a
traceback and never a silently wrong result: budgets, configs, data files, plans, checkpoints, models.

(Engine-level refusals have their own tests: tests/engine/test_bf16_and_inputs.py for budgets, step
shapes and unsupported models, tests/scheduler/test_plan.py for plans of another model or schema,
tests/train/test_checkpoint.py for truncated and altered checkpoint files.)
"""

import hashlib
import json
import shutil

import pytest

from slidedp.run.checkpoint import CheckpointError, verify_checkpoint
from slidedp.cli import main
from slidedp.train.config import load_config
from slidedp.train.job import list_checkpoints, run
from slidedp.train.sources import Example, build_rows
from tests.reliability.conftest import overrides


def error_line(capsys, command="train") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"slidedp {command}: error: "), last
    return last


def train(rel_model_dir, data, tmp_path, *extra) -> int:
    return main(["train", *overrides(rel_model_dir, data, tmp_path / "run", "max_steps=1", "save_every=0", *extra)])


# -- budgets and configs ------------------------------------------------------------------------

@pytest.mark.parametrize("value, words", [
    ("lots", "config key 'budget': cannot parse budget 'lots'"),
    ("0GiB", "config key 'budget': budget must be positive"),
    ("-3GiB", "config key 'budget': cannot parse budget '-3GiB'"),
    ("1e9", "config key 'budget': cannot parse budget '1e9'"),
])
def test_bad_budget_is_refused_before_loading_anything(value, words, capsys):
    assert main(["train", f"budget={value}"]) == 2
    assert words in error_line(capsys)


def test_bad_budget_for_plan(capsys):
    assert main(["plan", "llama-tiny", "--budget", "12 parsecs", "--batch-size", "1", "--seq-len", "8"]) == 2
    assert "cannot parse budget '12 parsecs'" in error_line(capsys, "plan")


@pytest.mark.parametrize("text, words", [
    ("max_steps: [1, 2]\n", "config key 'max_steps' must be an integer, got [1, 2]"),
    ("lr: {a: 1}\n", "config key 'lr' must be a number"),
    ("lr: .nan\n", "config key 'lr' must be a finite number"),
    ("lr: .inf\n", "config key 'lr' must be a finite number"),
    ("max_steps: 3\n  bad indent: [\n", "run.yaml: not valid YAML"),
    ("data: [a.jsonl, 3]\n", "config key 'data': a list must hold file or folder names"),
    ("- just\n- a list\n", "must hold a mapping"),
    ("max_stepz: 3\n", "unknown config key(s): max_stepz"),
    ("max_skipped_steps: -1\n", "'max_skipped_steps' must be >= 0"),
    ("output_dir: ''\n", "config key 'output_dir' must not be empty"),
])
def test_bad_config_file_names_the_key_or_file(text, words, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["train", str(path)]) == 2
    assert words in error_line(capsys)


def test_bad_toml_and_json_config_name_the_file(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("max_steps = = 3\n")
    (tmp_path / "run.json").write_text("{max_steps: 3}")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00bad")
    for name, words in (("run.toml", "not valid TOML"), ("run.json", "not valid JSON"), ("bin.yaml", "UTF-8")):
        assert main(["train", str(tmp_path / name)]) == 2
        assert f"{name}: " in (line := error_line(capsys)) and words in line


# -- data files ---------------------------------------------------------------------------------

def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("content, words", [
    ('{"text": "fine"}\n{"text": "cut\n', "bad.jsonl line 2: not valid JSON"),
    ("", "bad.jsonl is empty: it holds no example"),
    ("\n\n  \n", "bad.jsonl is empty: it holds no example"),
    ('{"text": "fine"}\n{"text": ""}\n', "bad.jsonl line 2: 'text' is empty"),
    ('{"text": "fine"}\n{"text": 7}\n', "bad.jsonl line 2: 'text' must be a string, got int"),
    ('{"prompt": "p", "completion": ""}\n', "bad.jsonl line 1: 'completion' is empty"),
    ('{"question": "q"}\n', "bad.jsonl line 1: expected a 'text' field, or 'prompt' and 'completion', or 'messages' (or 'conversations') (found ['question'])"),
])
def test_bad_jsonl_is_named_by_file_and_line(content, words, rel_model_dir, tmp_path, capsys):
    data = write(tmp_path / "bad.jsonl", content)
    assert train(rel_model_dir, data, tmp_path) == 2
    assert words in error_line(capsys)


def test_invalid_utf8_line_is_named(rel_model_dir, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "\xff\xfe"}\n')
    assert train(rel_model_dir, data, tmp_path) == 2
    assert "bad.jsonl line 2: not valid UTF-8" in error_line(capsys)


def test_empty_txt_file_is_named(rel_model_dir, rel_data, tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    shutil.copy(rel_data, folder / "a.jsonl")
    write(folder / "b.txt", "  \n\t\n")
    assert train(rel_model_dir, folder, tmp_path) == 2
    assert "b.txt is empty" in error_line(capsys)


def test_prompt_filling_the_row_all_labels_ignored_is_named(rel_model_dir, tmp_path, capsys):
    long_prompt = " ".join(["question"] * 200)
    data = write(tmp_path / "pc.jsonl", json.dumps({"prompt": "short?", "completion": " yes"}) + "\n"
                 + json.dumps({"prompt": long_prompt, "completion": " no"}) + "\n")
    assert train(rel_model_dir, data, tmp_path, "packing=false") == 2
    line = error_line(capsys)
    assert "pc.jsonl line 2: the prompt fills the whole row of seq_len=32 tokens" in line and "all labels -100" in line


def test_packed_data_with_no_trained_token_is_refused(rel_model_dir, tmp_path, capsys):
    data = write(tmp_path / "pc.jsonl", json.dumps({"prompt": " ".join(["question"] * 300), "completion": "!"}) + "\n")
    assert train(rel_model_dir, data, tmp_path, "packing=true") == 2
    assert "gives no row of 32 tokens with a trained label" in error_line(capsys)


def test_example_under_two_tokens_is_named():
    class NothingTokenizer:  # a tokenizer that gives no token for the text: only EOS would be left
        eos_token_id, pad_token_id = 0, 1

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": []}

    with pytest.raises(ValueError, match="data file x.jsonl line 4: gives 1 token.* needs at least 2"):
        build_rows(iter([Example("\u200b", source="data file x.jsonl line 4")]), NothingTokenizer(), 8, packing=True)


def test_missing_data_is_named(rel_model_dir, tmp_path, capsys):
    assert train(rel_model_dir, tmp_path / "nope.jsonl", tmp_path) == 2
    assert "config key 'data':" in (line := error_line(capsys)) and "nope.jsonl does not exist" in line


# -- plans, models ------------------------------------------------------------------------------

@pytest.mark.parametrize("content, words", [
    ("{not json", "not a plan"),
    (json.dumps({"schema_version": 999}), "schema version"),
])
def test_inspect_refuses_a_bad_plan_in_one_line(content, words, tmp_path, capsys):
    path = write(tmp_path / "plan.json", content)
    assert main(["inspect", str(path)]) == 2
    assert words in error_line(capsys, "inspect")


def test_unsupported_model_structure_in_one_line(rel_model_dir, rel_data, tmp_path, capsys, monkeypatch):
    """A model without a ModuleList of blocks (the structure slidedp streams) is refused by name."""
    import torch

    from slidedp.train import job

    class NoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(300, 8)
            self.head = torch.nn.Linear(8, 300)

        def forward(self, input_ids):
            return self.head(self.emb(input_ids))

    original = job.load_model_and_tokenizer
    monkeypatch.setattr(job, "load_model_and_tokenizer", lambda cfg: (NoBlocks(), original(cfg)[1]))
    assert train(rel_model_dir, rel_data, tmp_path) == 2
    assert "ModuleList of blocks" in error_line(capsys)


def test_corrupt_weights_file_in_one_line(rel_model_dir, rel_data, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(rel_model_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert train(folder, rel_data, tmp_path) == 2
    assert f"config key 'model': cannot load the weights of {folder}" in error_line(capsys)


# -- checkpoints ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(rel_model_dir, rel_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    run(load_config(None, overrides(rel_model_dir, rel_data, out, "max_steps=2")))
    return out


def damaged_copy(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out, list_checkpoints(out)[-1][1]


def rewrite_manifest(folder, change):
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def reseal(folder, rel):
    """A tamperer who also fixes the manifest's size and sha256."""
    data = (folder / rel).read_bytes()
    rewrite_manifest(folder, lambda m: m["files"][rel].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))


def test_checkpoint_tampering_is_refused_naming_the_file_or_key(finished_run, tmp_path, capsys):
    out, ck = damaged_copy(finished_run, tmp_path)
    original = (ck / "manifest.json").read_text()

    def refused(words):
        with pytest.raises(CheckpointError, match=words):
            verify_checkpoint(ck, required=("engine.json", "trainer_state.json"))
        (ck / "manifest.json").write_text(original)

    rewrite_manifest(ck, lambda m: m.pop("files"))
    refused("has no 'files' table")
    rewrite_manifest(ck, lambda m: m["files"].__setitem__("../../etc/passwd", {"sha256": "0", "bytes": 1}))
    refused(r"names '\.\./\.\./etc/passwd', which is not a path inside")
    rewrite_manifest(ck, lambda m: m["files"]["engine.json"].update(bytes="12"))
    refused("entry of engine.json is not")
    rewrite_manifest(ck, lambda m: m["files"].pop("trainer_state.json"))
    refused("manifest.json does not list trainer_state.json")
    (ck / "extra.safetensors").write_bytes(b"planted")
    refused("file extra.safetensors is not listed")
    (ck / "extra.safetensors").unlink()
    verify_checkpoint(ck)  # restored: fine again


@pytest.mark.parametrize("rel, change, words", [
    ("engine.json", lambda d: d.update(step="many"), "engine.json key 'step' must be an integer"),
    ("engine.json", lambda d: d.update(layers=[{"id": 0}]), "engine.json key 'layers' is not a list"),
    ("trainer_state.json", lambda d: d.pop("data"), "trainer_state.json key 'data' is missing"),
])
def test_resealed_metadata_with_bad_values_is_refused(rel, change, words, finished_run, rel_model_dir, rel_data,
                                                      tmp_path, capsys):
    out, ck = damaged_copy(finished_run, tmp_path)
    data = json.loads((ck / rel).read_text())
    change(data)
    (ck / rel).write_text(json.dumps(data))
    reseal(ck, rel)
    assert main(["train", *overrides(rel_model_dir, rel_data, out, "max_steps=3", "resume=true")]) == 2
    assert words in error_line(capsys)


def test_export_of_a_truncated_checkpoint_names_the_file(finished_run, tmp_path, capsys):
    out, ck = damaged_copy(finished_run, tmp_path)
    layer = ck / "state" / "layer-00002.safetensors"
    layer.write_bytes(layer.read_bytes()[:50])
    assert main(["export", str(ck), str(tmp_path / "hf")]) == 2
    assert "state/layer-00002.safetensors has 50 bytes" in error_line(capsys, "export")


# -- silent risks: sequences beyond the model's positions, budgets without a unit -----------------

def _meta_llama(**config):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, **config)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def test_seq_len_beyond_the_models_positions_is_refused_naming_both_numbers():
    import slidedp

    smollm2_like = _meta_llama(max_position_embeddings=8192)  # SmolLM2's limit
    with pytest.raises(ValueError, match=r"seq_len 9000 is beyond the 8192 positions"):
        slidedp.plan(smollm2_like, "24GiB", batch_size=1, seq_len=9000, hardware="h100-sxm")
    with pytest.raises(ValueError, match=r"seq_len 9000 is beyond the 8192 positions"):
        slidedp.compile(smollm2_like, "24GiB", batch_size=1, seq_len=9000, device="cpu")
    # a rope_scaling setting extends it: to the scaled limit where that is a plain factor
    yarn = _meta_llama(max_position_embeddings=8192, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 8192})
    from slidedp.api import check_positions

    check_positions(yarn, 32768)
    with pytest.raises(ValueError, match=r"seq_len 40000 is beyond the 32768 positions .*factor 4"):
        check_positions(yarn, 40000)
    check_positions(_meta_llama(max_position_embeddings=8192, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                    100_000)
    check_positions(_meta_llama(max_position_embeddings=8192), 8192)  # the limit itself is fine


def test_plan_command_refuses_seq_len_beyond_the_presets_positions(capsys):
    assert main(["plan", "qwen3-14b", "--budget", "40GiB", "--batch-size", "1", "--seq-len", "100000",
                 "--hardware", "h100-sxm"]) == 2
    line = error_line(capsys, "plan")
    assert "seq_len 100000" in line and "40960" in line


def test_train_refuses_seq_len_beyond_the_models_positions(rel_model_dir, rel_data, tmp_path, capsys):
    assert train(rel_model_dir, rel_data, tmp_path, "seq_len=300") == 2  # the tiny model allows 256
    line = error_line(capsys)
    assert "seq_len 300" in line and "256" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("command", [
    ["train", "budget=24"],
    ["plan", "llama-tiny", "--budget", "24", "--batch-size", "1", "--seq-len", "8"],
    ["bench", "llama-tiny", "--budget", "24", "--seq-len", "8", "--tokens", "8"],
])
def test_a_budget_without_a_unit_is_refused_at_the_command_line(command, capsys):
    assert main(command) == 2
    line = error_line(capsys, command[0])
    assert "24 has no unit" in line and "24GiB" in line
    assert ("'budget'" if command[0] == "train" else "--budget") in line


def test_a_budget_in_bytes_stays_bytes_in_python_and_explicit_at_the_command_line():
    from slidedp.budget import Budget

    assert Budget.parse(24).device_bytes == 24
    assert load_config(None, ["budget=2000000000B"]).engine.budget == "2000000000B"
    with pytest.raises(ValueError, match="config key 'budget': budget 24 has no unit"):
        load_config(None, ["budget=24"])
    path_values = {"budget": 24}  # a YAML/JSON number
    from slidedp.train.config import TrainConfig

    with pytest.raises(ValueError, match="has no unit"):
        TrainConfig.from_dict(path_values)
