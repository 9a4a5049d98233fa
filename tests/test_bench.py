"""`slidedp bench`: both systems measured in one process; ratios and predicted vs measured."""

import json

from slidedp.cli import main


def test_bench_measures_both_systems_and_their_ratio(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "llama-tiny", "--budget", "1GiB", "--batch-size", "2", "--seq-len", "32",
                 "--tokens", "64", "128", "--steps", "1", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    records = result["records"]
    assert [(r["system"], r["tokens_per_step"]) for r in records] == [
        ("slidedp", 64), ("pytorch", 64), ("slidedp", 128), ("pytorch", 128)]
    for r in records:
        assert r["tokens_per_s"] > 0 and abs(r["tokens_per_s"] * r["measured_step_s"] - r["tokens_per_step"]) < 1e-6
    for r, (s, b) in zip(result["ratios"], [records[0:2], records[2:4]]):
        assert abs(r["slidedp_over_pytorch"] - s["tokens_per_s"] / b["tokens_per_s"]) < 1e-9
        assert abs(r["measured_over_predicted"] - s["measured_step_s"] / s["predicted_step_s"]) < 1e-9
    assert "x PyTorch; measured / predicted step" in capsys.readouterr().out


def test_bench_refuses_tokens_that_do_not_divide(capsys):
    assert main(["bench", "llama-tiny", "--budget", "1GiB", "--batch-size", "2", "--seq-len", "32",
                 "--tokens", "100", "--device", "cpu"]) == 2
    assert "not a positive multiple of batch_size x seq_len" in capsys.readouterr().err
