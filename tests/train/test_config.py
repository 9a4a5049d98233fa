"""The train config's sections: flat, sectioned and dotted keys load to the same config; old flat files load."""

import json

import pytest

from slidedp.train.config import SECTION_OF, SECTIONS, OptimizerConfig, TrainConfig, load_config

# config.json as the flat TrainConfig of earlier versions wrote it (every key, one level)
OLD_FLAT = {
    "model": "some/folder", "tokenizer": "", "data": "a.jsonl,b", "packing": False, "max_rows": 0,
    "val_fraction": 0.25, "val_every": 1, "output_dir": "runs/old", "max_steps": 4, "batch_size": 2,
    "grad_accum": 2, "seq_len": 32, "precision": "fp32", "device": "cpu", "world_size": 1, "budget": "16GiB",
    "lr": 0.005, "lr_schedule": "cosine", "warmup_steps": 3, "min_lr": 0.0, "weight_decay": 0.1,
    "no_decay_groups": True, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-08, "max_grad_norm": 1.0,
    "max_skipped_steps": 10, "save_every": 2, "keep_last": 3, "resume": False, "overwrite": False, "seed": 0,
    "log_every": 1, "progress": False, "tensorboard": True,
}


NEW_KEYS = ("encoding", "host_memory", "chat_template", "val_data", "report_to", "link", "nonfinite",
            "group_rows")  # keys added since: an old flat file without them loads with their defaults


def test_every_key_is_in_exactly_one_section():
    assert sorted(SECTION_OF) == sorted([*OLD_FLAT, *NEW_KEYS])
    assert sum(len(s.__dataclass_fields__) for s in SECTIONS.values()) == len(OLD_FLAT) + len(NEW_KEYS)
    with pytest.raises(TypeError):
        OptimizerConfig(1e-3)  # keyword-only
    with pytest.raises(AttributeError):
        TrainConfig().optimizer.lr = 1.0  # frozen


def test_flat_and_sectioned_files_load_to_the_same_config(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: some/folder\ndata: [a.jsonl, b]\nlr: 1.0e-3\nwarmup_steps: 5\nbudget: 8GiB\n"
                    "save_every: 2\nprogress: false\n")
    sectioned = tmp_path / "sectioned.yaml"
    sectioned.write_text("model: {model: some/folder}\ndata:\n  data: [a.jsonl, b]\noptimizer:\n  lr: 1.0e-3\n"
                         "schedule: {warmup_steps: 5}\nengine: {budget: 8GiB}\ncheckpoint: {save_every: 2}\n"
                         "metrics: {progress: false}\n")
    toml = tmp_path / "sectioned.toml"
    toml.write_text('model = "some/folder"\ndata = ["a.jsonl", "b"]\n[optimizer]\nlr = 1e-3\n[schedule]\n'
                    'warmup_steps = 5\n[engine]\nbudget = "8GiB"\n[checkpoint]\nsave_every = 2\n'
                    '[metrics]\nprogress = false\n')
    mixed = tmp_path / "mixed.json"  # flat keys beside sections and dotted keys
    mixed.write_text(json.dumps({"model": "some/folder", "data": {"data": "a.jsonl,b"}, "optimizer.lr": 1e-3,
                                 "warmup_steps": 5, "engine": {"budget": "8GiB"}, "save_every": 2,
                                 "metrics": {"progress": False}}))
    cfg = load_config(str(flat), [])
    assert (cfg.model.model, cfg.data.data, cfg.optimizer.lr, cfg.schedule.warmup_steps, cfg.engine.budget,
            cfg.checkpoint.save_every, cfg.metrics.progress) == ("some/folder", "a.jsonl,b", 1e-3, 5, "8GiB", 2, False)
    for other in (sectioned, toml, mixed):
        assert load_config(str(other), []) == cfg, other.name


def test_dotted_and_flat_overrides(tmp_path):
    flat = load_config(None, ["lr=0.01", "max_steps=7", "model=m", "resume=true", "tokenizer="])
    dotted = load_config(None, ["optimizer.lr=0.01", "training.max_steps=7", "model.model=m",
                                "checkpoint.resume=true", "model.tokenizer="])
    assert flat == dotted and flat.optimizer.lr == 0.01 and flat.checkpoint.resume is True
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {lr: 0.5}\nmax_steps: 3\n")
    cfg = load_config(str(path), ["lr=0.25", "training.max_steps=4", "optimizer.lr=0.125"])  # the last one wins
    assert (cfg.optimizer.lr, cfg.training.max_steps) == (0.125, 4)
    with pytest.raises(TypeError, match="'max_steps' must be an integer"):
        load_config(None, ["training.max_steps=three"])
    with pytest.raises(ValueError, match="'lr' must be a finite number"):
        load_config(None, ["optimizer.lr=-1"])


@pytest.mark.parametrize("overrides, words", [
    (["optimizer.warmup_steps=3"], r"unknown config key\(s\): optimizer.warmup_steps \('warmup_steps' belongs in "
                                   r"section 'schedule'\)"),
    (["model.lr=1"], r"model.lr \('lr' belongs in section 'optimizer'\)"),
    (["optimizr.lr=1"], r"unknown config key\(s\): optimizr.lr \('lr' belongs in section 'optimizer'\)"),
    (["optimizer.lrr=1"], r"unknown config key\(s\): optimizer.lrr \(did you mean 'lr'\?\) \(known"),
    (["lrr=1"], r"unknown config key\(s\): lrr \(did you mean 'lr'\?\) \(known"),
    (["optimizer=1"], "config section 'optimizer' must be a mapping"),
])
def test_key_in_the_wrong_section_or_unknown_is_refused_naming_it(overrides, words):
    with pytest.raises(ValueError, match=words):
        load_config(None, overrides)


@pytest.mark.parametrize("text, words", [
    ("optimizer: {warmup_steps: 3}\n", r"optimizer.warmup_steps \('warmup_steps' belongs in section 'schedule'\)"),
    ("schedule: {lr: 0.1}\n", r"schedule.lr \('lr' belongs in section 'optimizer'\)"),
    ("training: {max_stepz: 3}\n", r"unknown config key\(s\): training.max_stepz"),
    ("lr: 0.1\noptimizer: {lr: 0.2}\n", "config key 'lr' is given twice"),
    ("optimizer: [1, 2]\n", "config section 'optimizer' must be a mapping"),
    ("optimizer: {lr: fast}\n", "'lr' must be a number"),
    ("model: {model: [a]}\n", "'model' must be a string"),
])
def test_bad_sectioned_file_is_refused_naming_the_key(tmp_path, text, words):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises((ValueError, TypeError), match=words):
        load_config(str(path), [])


def test_config_json_round_trip_and_old_flat_config_json(tmp_path):
    cfg = load_config(None, [f"{k}={v}" for k, v in OLD_FLAT.items()])
    written = tmp_path / "config.json"
    written.write_text(json.dumps(cfg.to_dict(), indent=2))
    assert set(json.loads(written.read_text())) == set(SECTIONS)  # written in sections
    assert load_config(str(written), []) == cfg == TrainConfig.from_dict(cfg.to_dict())
    old = tmp_path / "old" / "config.json"  # as the previous version wrote it into a run folder
    old.parent.mkdir()
    old.write_text(json.dumps(OLD_FLAT, indent=2))
    assert load_config(str(old), []) == cfg
    assert TrainConfig.from_dict(OLD_FLAT) == cfg  # a trainer_state.json's flat config
    assert load_config(str(old), ["resume=true"]).checkpoint.resume is True


def test_group_rows_takes_true_false_or_auto():
    """group_rows: auto by default, true/false as the other booleans; anything else refused naming it."""
    assert load_config(None, []).training.group_rows == "auto"
    for given, value in (("auto", "auto"), ("AUTO", "auto"), ("true", True), ("no", False)):
        assert load_config(None, [f"training.group_rows={given}"]).training.group_rows == value
    for bad in ("maybe", "2"):
        with pytest.raises(TypeError, match="'group_rows' must be true, false or auto"):
            load_config(None, [f"group_rows={bad}"])
