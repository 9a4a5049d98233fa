"""Every field of a given plan, hardware profile, optimizer and config checked before use, and
user text decoded strictly: each fault is refused naming the field, key, file or line (docs/reliability.md)."""

import json
import math

import pytest
import torch

import slidedp
from slidedp import api
from slidedp.budget import Budget

MAX_BUDGET_BYTES = 2**60  # slidedp.budget.MAX_BUDGET_BYTES
from slidedp.cli import main
from slidedp.costmodel.hardware import PRESETS, Hardware, resolve_hardware
from slidedp.scheduler.plan import Plan
from slidedp.train.config import load_config
from slidedp.train.loading import load_dataset
from slidedp.train.sources import iter_examples
from tests.models import make_model

KW = dict(batch_size=2, seq_len=16, precision="fp32", device="cpu")


@pytest.fixture(scope="module")
def plan_dict():
    return slidedp.plan(make_model("llama"), "1GiB", **KW).to_dict()


def _edit(data, path, value):
    *keys, last = path
    for k in keys:
        data = data[k]
    data[last] = value(data[last]) if callable(value) else value


# (where in the plan JSON, new value, the field the error must name)
PLAN_FAULTS = [
    (("schedule", "decisions", 1, "owners"), [5], "owners"),
    (("schedule", "decisions", 1, "owners"), [0, 0], "owners"),
    (("schedule", "decisions", 1, "numel"), lambda n: n + 1, "numel"),
    (("schedule", "decisions", 1, "numel"), "many", "numel"),
    (("schedule", "decisions", 1, "name"), "model.layers.9", "name"),
    (("schedule", "decisions", 1, "kind"), "epilogue", "kind"),
    (("schedule", "decisions", 2, "layer_id"), 7, "layer_id"),
    (("schedule", "decisions", 1, "chunks"), 0, "chunks"),
    (("schedule", "decisions", 1, "chunks"), 10**9, "chunks"),
    (("schedule", "decisions", 1, "activation"), "resident", "activation"),
    (("schedule", "decisions", 0, "activation"), "keep", "activation"),
    (("schedule", "decisions", 1, "delivery"), "sharded", "delivery"),
    (("schedule", "decisions", 1, "reduction"), "gpu", "reduction"),
    (("schedule", "decisions", 1, "reduction"), "teleport", "reduction"),
    (("schedule", "window"), 0, "window"),
    (("schedule", "window"), 99, "window"),
    (("schedule", "window_loads"), lambda loads: loads[:-1], "window_loads"),
    (("schedule", "window_loads", 0, 2), 7, "window_loads"),
    (("schedule", "window_loads"), lambda loads: [loads[0], loads[0], *loads[1:]], "window_loads"),
    (("schedule", "update_order"), [0, 0, 1, 2, 3], "update_order"),
    (("schedule", "device_state"), [99], "device_state"),
    (("schedule", "early_order"), [1, 1], "early_order"),
    (("schedule", "streamed_updates"), [-1], "streamed_updates"),
    (("schedule", "loss_chunk_tokens"), -1, "loss_chunk_tokens"),
    (("workload", "micro_batches"), 0, "micro_batches"),
    (("explanation", "peak_device_bytes"), 2**31, "peak_device_bytes"),
]


@pytest.mark.parametrize("where, value, field", PLAN_FAULTS, ids=[f"{'.'.join(map(str, w))}" for w, _, _ in PLAN_FAULTS])
def test_every_field_of_a_given_plan_is_checked(tmp_path, plan_dict, where, value, field):
    data = json.loads(json.dumps(plan_dict))
    _edit(data, where, value)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field):
        slidedp.plan(make_model("llama"), "1GiB", plan=path, **KW)
    # inspect warns what compile would refuse (the self-consistency part), and still shows the plan
    if not (where[-1] in ("numel", "name") and field in ("numel", "name") and not isinstance(value, str)
            or where[-1] == "name"):  # these need the model: compile names them, inspect cannot
        problems = Plan.load(path).problems()
        assert problems and field in problems[0]


def test_a_plan_with_a_rank_that_does_not_exist_is_refused_by_compile(tmp_path, plan_dict):
    data = json.loads(json.dumps(plan_dict))
    for d in data["schedule"]["decisions"]:
        d["owners"] = [3] * d["chunks"]  # rank 3 of 1: nobody would update the weights
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"decisions\[0\]\.owners must be ranks 0\.\.0"):
        slidedp.compile(make_model("llama"), "1GiB", plan=tmp_path / "plan.json", **KW)


def test_a_plan_for_another_seq_len_names_seq_len_not_the_fingerprint(tmp_path, plan_dict):
    (tmp_path / "plan.json").write_text(json.dumps(plan_dict))
    with pytest.raises(ValueError, match="seq_len is 16 in the plan but 32 here"):
        slidedp.plan(make_model("llama"), "1GiB", plan=tmp_path / "plan.json", **{**KW, "seq_len": 32})


def test_inconsistent_window_loads_reaching_the_lowering_are_named(plan_dict):
    plan = Plan.from_dict(plan_dict)
    bad = plan.replace(window_loads=plan.window_loads[:-1])
    request = api.check_request(make_model("llama"), "1GiB", world_size=1, optimizer=None, max_grad_norm=None,
                                hardware=None, micro_batches=1, compile_blocks=None, **KW)
    with pytest.raises(ValueError, match="window_loads"):
        api.lower_plan(api.trace(request, plan), bad)


@pytest.mark.parametrize("text", ["5", "[1, 2]", '"plan"', '{"schema_version": 3}',
                                  '{"schema_version": 3, "slidedp_version": "x", "model_fingerprint": "f", '
                                  '"model_class": "M", "workload": {"batch_size": 2}, "budget_bytes": 1, '
                                  '"hardware": {}, "schedule": {}}',
                                  '{"schema_version": 3, "slidedp_version": "x", "model_fingerprint": "f", '
                                  '"model_class": "M", "workload": {"batch_size": 2, "seq_len": 16, "world_size": 1, '
                                  '"precision": "fp32", "micro_batches": 1}, "budget_bytes": 1, "hardware": {}, '
                                  '"schedule": {"window": 1, "decisions": 5, "window_loads": []}}'])
def test_a_file_that_is_not_a_plan_is_refused_naming_it(tmp_path, capsys, text):
    path = tmp_path / "odd-plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{path}: (not a plan|plan schema version)"):
        Plan.load(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "odd-plan.json" in err and "internal error" not in err and len(err.strip().splitlines()) == 1


def test_inspect_and_report_warn_what_compile_would_refuse(tmp_path, capsys, plan_dict):
    data = json.loads(json.dumps(plan_dict))
    data["schedule"]["decisions"][1]["owners"] = [5]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["inspect", str(path)]) == 0
    captured = capsys.readouterr()
    assert "warning: compile would refuse" in captured.err and "owners" in captured.err
    assert "slidedp plan for" in captured.out
    assert main(["report", str(path), "--trace", str(tmp_path / "t.json")]) == 0
    assert "owners" in capsys.readouterr().err


def test_solved_plans_are_valid():
    for kw in (dict(), dict(batch_size=1, seq_len=8), dict(world_size=2, hardware="h100-sxm", device="auto")):
        plan = slidedp.plan(make_model("qwen3"), "1GiB", **{**KW, **kw})
        assert plan.problems() == [], plan.problems()


# -- user text decoded strictly ---------------------------------------------------------------

class _Tok:
    eos_token_id = 0
    pad_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + (ord(c) % 50) for c in text]}


@pytest.mark.parametrize("raw, offset", [
    (bytes(range(128, 256)), 0),  # random-looking bytes
    ("caf\xe9 au lait".encode("latin-1"), 3),  # Latin-1
    (b"\xef\xbb\xbfok \xff", 6),  # after a BOM: the offset in the file
])
def test_txt_that_is_not_utf8_is_refused_naming_file_and_byte(tmp_path, raw, offset):
    path = tmp_path / "doc.txt"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"doc\.txt: not valid utf-8 text at byte {offset}\b"):
        list(iter_examples([path]))
    with pytest.raises(ValueError, match="doc.txt"):
        load_dataset(str(path), _Tok(), 4)


def test_txt_coding_comment_is_not_honoured_and_encoding_key_is(tmp_path):
    cookie = tmp_path / "cookie.txt"
    cookie.write_bytes(b"# -*- coding: latin-1 -*-\ncaf\xc3\xa9\n")
    assert [e.text for e in iter_examples([cookie])] == ["# -*- coding: latin-1 -*-\ncaf\xe9\n"]  # UTF-8, as given
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    assert [e.text for e in iter_examples([latin], "latin-1")] == ["caf\xe9"]
    assert load_config(None, ["encoding=latin-1"]).data.encoding == "latin-1"
    assert load_config(None, []).data.encoding == "utf-8"
    for bad in ("klingon", "base64"):
        with pytest.raises(ValueError, match="config key 'encoding'"):
            load_config(None, [f"encoding={bad}"])


# -- hardware profiles ------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("h2d_bytes_per_s", 0), ("cpu_adamw_params_per_s", 0.0), ("matmul_flops_per_s", -1e12),
    ("gpu_memory_bytes", 0), ("gpu_memory_bytes", -1), ("block_efficiency", math.inf),
    ("duplex_bytes_per_s", "fast"), ("cpu_cores", 2.5), ("cpu_cores", True), ("gpus_per_root_complex", 0),
    ("gpu_p2p_bytes_per_s", -1.0), ("attention_flops_per_s", math.nan), ("host_block_fwd_s", -0.1),
    ("cpu_adamw_contended_fraction", 1.5), ("name", ""), ("transfer_efficiency", 5),
])
def test_every_hardware_field_is_checked_naming_file_and_field(tmp_path, field, value):
    path = tmp_path / "profile.json"
    data = {**PRESETS["h100-sxm"].to_dict(), field: value}
    path.write_text(json.dumps(data, allow_nan=True))
    with pytest.raises(ValueError, match=rf"profile\.json.*'{field}'"):
        resolve_hardware(str(path), "cpu")


def test_a_hardware_profile_that_is_not_json_or_misses_keys_is_named(tmp_path):
    path = tmp_path / "prof.json"
    path.write_text("gpu: fast")
    with pytest.raises(ValueError, match="prof.json: not a hardware profile JSON"):
        resolve_hardware(str(path), "cpu")
    data = PRESETS["cpu"].to_dict()
    del data["cpu_cores"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="prof.json.*'cpu_cores'"):
        resolve_hardware(str(path), "cpu")
    path.write_text("[1]")
    with pytest.raises(ValueError, match="prof.json"):
        resolve_hardware(str(path), "cpu")
    for preset in PRESETS.values():
        assert Hardware.from_dict(preset.to_dict()) == preset


def test_a_zero_rate_profile_is_refused_by_the_plan_command(tmp_path, capsys):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({**PRESETS["cpu"].to_dict(), "cpu_adamw_params_per_s": 0}))
    assert main(["plan", "llama-tiny", "--budget", "1GiB", "--seq-len", "16", "--batch-size", "1", "--hardware", str(path),
                 "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "zero.json" in err and "cpu_adamw_params_per_s" in err and "internal error" not in err


# -- the Python API checks what the config checks ---------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=math.inf), "lr"), (dict(lr=math.nan), "lr"), (dict(lr=-1e-3), "lr"), (dict(eps=0), "eps"),
    (dict(eps=-1e-8), "eps"), (dict(eps=math.inf), "eps"), (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]"), (dict(betas=(0.9, math.nan)), r"betas\[1\]"),
    (dict(weight_decay=math.inf), "weight_decay"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr="1e-3"), "lr"), (dict(betas=0.9), "betas"),
])
def test_adamw_arguments_are_checked_naming_them(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=rf"AdamW {name}"):
        slidedp.AdamW(**kwargs)


def test_config_refuses_adam_eps_zero():
    with pytest.raises(ValueError, match="adam_eps"):
        load_config(None, ["adam_eps=0"])


@pytest.mark.parametrize("name, text", [
    ("c.yaml", "lr: 1e-4\nmax_steps: 3\nlr: 1e-3\n"),
    ("s.yaml", "optimizer:\n  lr: 1e-4\n  lr: 1e-3\n"),
    ("c.json", '{"lr": 1e-4, "lr": 1e-3}'),
    ("s.json", '{"optimizer": {"lr": 1e-4, "lr": 1e-3}}'),
])
def test_duplicate_keys_in_yaml_and_json_configs_are_refused(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{name}: key 'lr' is given twice"):
        load_config(str(path), [])


# -- clear messages instead of internal errors -------------------------------------------------

@pytest.mark.parametrize("budget", ["9" * 400, 10**400, "99999999999999TiB", 2**63, float("inf")])
def test_absurd_budgets_are_refused_naming_the_limit(budget):
    with pytest.raises(ValueError, match="budget"):
        Budget.parse(budget)
    assert Budget.parse(MAX_BUDGET_BYTES).device_bytes == MAX_BUDGET_BYTES


def test_plan_command_with_a_huge_budget_exits_2(tmp_path, capsys):
    assert main(["plan", "llama-tiny", "--budget", "99999999999999TiB", "--seq-len", "16", "--batch-size", "1",
                 "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "above the largest accepted" in err and str(MAX_BUDGET_BYTES) in err and "internal error" not in err


def test_a_huge_budget_is_refused_by_the_train_config():
    with pytest.raises(ValueError, match="config key 'budget'.*largest accepted"):
        load_config(None, ["budget=" + "9" * 400])


@pytest.mark.parametrize("seed", ["99999999999999999999999999", "-1", str(2**32)])
def test_a_seed_out_of_range_is_refused_naming_the_range(seed):
    with pytest.raises(ValueError, match=r"config key 'seed' must be in 0\.\.4294967295"):
        load_config(None, [f"seed={seed}"])
    assert load_config(None, [f"seed={2**32 - 1}"]).training.seed == 2**32 - 1


def test_deeply_nested_json_is_named(tmp_path):
    data = tmp_path / "deep.jsonl"
    data.write_text('{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match="deep.jsonl line 2: JSON nested too deeply"):
        list(iter_examples([data]))
    for suffix in ("json", "yaml"):
        cfg = tmp_path / f"deep.{suffix}"
        cfg.write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(ValueError, match=f"deep.{suffix}: not valid"):
            load_config(str(cfg), [])
    plan = tmp_path / "deep-plan.json"
    plan.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="deep-plan.json: not a plan"):
        Plan.load(plan)


@pytest.mark.parametrize("line, words", [
    ("[1, 2]", "got list"), ("5", "got int"), ('{"text": null}', "'text' must be a string, got null"),
    ('{"text": {"a": 1}}', "got dict"), ('{"prompt": 1, "completion": "x"}', "'prompt' must be a string, got int"),
    ('{"prompt": "p", "completion": ["x"]}', "'completion' must be a string, got list"),
])
def test_jsonl_lines_of_the_wrong_types_are_named(tmp_path, line, words):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"d\.jsonl line 2: .*{words}"):
        list(iter_examples([path]))


def test_parquet_rows_of_the_wrong_types_are_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for table, words in [(pa.table({"text": [1, 2]}), "row 0: 'text' must be a string, got int"),
                         (pa.table({"text": ["a", None]}), "row 1: 'text' must be a string, got null"),
                         (pa.table({"prompt": ["a"], "completion": [[1]]}), "row 0: 'completion' must be a string")]:
        path = tmp_path / "d.parquet"
        pq.write_table(table, path)
        with pytest.raises(ValueError, match=words):
            list(iter_examples([path]))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="junk.parquet: not a readable parquet file"):
        list(iter_examples([tmp_path / "junk.parquet"]))


def test_the_train_job_decodes_txt_in_the_configured_encoding(tmp_path):
    """`encoding` reaches the data of `slidedp train`: Latin-1 text is refused as UTF-8 and read as Latin-1."""
    from slidedp.train.config import load_config
    from slidedp.train.job import load_data
    from tests.train.conftest import make_tokenizer

    (tmp_path / "doc.txt").write_bytes(("the caf\u00e9 cr\u00e8me " * 200).encode("latin-1"))
    tokenizer = make_tokenizer()
    for encoding, ok in (("utf-8", False), ("latin-1", True)):
        cfg = load_config(None, [f"data={tmp_path / 'doc.txt'}", f"encoding={encoding}", "seq_len=16"])
        if ok:
            assert len(load_data(cfg, tokenizer)) > 0
        else:
            with pytest.raises(ValueError, match="not valid utf-8"):
                load_data(cfg, tokenizer)
