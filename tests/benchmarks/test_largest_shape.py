"""benchmarks/largest_shape: host state of each Qwen3 size against a given amount of RAM."""

import json

import pytest


def test_largest_shape_counts_sixteen_bytes_per_parameter(tmp_path, monkeypatch):
    """benchmarks/largest_shape: host state of each Qwen3 size against a given amount of RAM."""
    from slidedp.run import preflight

    import benchmarks.largest_shape.run as mod

    monkeypatch.setitem(mod.SHAPES, "tiny", (64, 128, 2, 4, 2, 16, 512, True))
    for name in ("1.7b", "8b", "14b", "32b"):  # keep the test quick: 0.6b, 4b and the tiny one
        monkeypatch.delitem(mod.SHAPES, name)
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 40 << 30)
    out = tmp_path / "largest.json"
    assert mod.main(["--out", str(out), "--allow-dirty"]) == 0
    result = json.loads(out.read_text())
    by = {r["shape"]: r for r in result["shapes"]}
    assert abs(by["4b"]["bytes_per_param"] - 16.0) < 0.01 and by["4b"]["params"] == 4_411_424_256
    assert by["0.6b"]["fits"] and not by["4b"]["fits"]  # 65.7 GiB > 40 GiB
    assert result["largest"] == "0.6b"
    # the state of leading layers on the GPU: the host keeps none of their 16 bytes per parameter
    assert mod.main(["--out", str(out), "--device-state", "40GiB", "--allow-dirty"]) == 0
    lean = {r["shape"]: r for r in json.loads(out.read_text())["shapes"]}
    assert lean["4b"]["fits"]
    # 40 GiB / 14 B per parameter: the embedding (388,956,160) and 26 blocks of 100,930,816
    assert lean["4b"]["device_state_layers"] == 27
    assert lean["4b"]["device_state_params"] == 388_956_160 + 26 * 100_930_816
    saved = by["4b"]["host_state_bytes"] - lean["4b"]["host_state_bytes"]
    assert saved == pytest.approx(16 * lean["4b"]["device_state_params"], rel=1e-3)


def test_the_record_names_its_commit_and_a_dirty_tree_is_refused(tmp_path, monkeypatch):
    """Every study's run.py stamps its record (benchmarks/common/records.commit_stamp), largest_shape for one."""
    from slidedp.run import preflight

    import benchmarks.common.records as records
    import benchmarks.largest_shape.run as mod

    monkeypatch.setattr(mod, "SHAPES", {"tiny": (64, 128, 2, 4, 2, 16, 512, True)})
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 40 << 30)
    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    out = tmp_path / "largest.json"
    monkeypatch.setattr(records, "changed_files", lambda: [])  # a clean tree
    assert mod.main(["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["git_commit"] == records.git_commit() and len(result["git_commit"]) == 40
    assert result["dirty"] is False and result["largest"] == "tiny"
    monkeypatch.setattr(records, "changed_files", lambda: ["slidedp/api.py"])  # uncommitted changes
    out.unlink()
    with pytest.raises(records.DirtyTreeError, match="--allow-dirty"):
        mod.main(["--out", str(out)])
    assert not out.exists()  # refused before anything was measured or written
    assert mod.main(["--out", str(out), "--allow-dirty"]) == 0
    assert json.loads(out.read_text())["dirty"] is True
