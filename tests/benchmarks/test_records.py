"""benchmarks/common/records.py: every record names the commit it measured; a tree with uncommitted
changes is refused unless --allow-dirty, and its records are then marked."""

import subprocess

import pytest

from benchmarks.common import records


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "study" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "study" / "results" / "r.json").write_text("[]\n")
    (tmp_path / "README.md").write_text("# r\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "first")
    monkeypatch.setattr(records, "REPO", tmp_path)
    return tmp_path


def test_a_clean_tree_is_stamped_with_its_commit(repo):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert records.commit_stamp() == {"git_commit": head, "dirty": False}
    # records and READMEs that a run rewrites do not make the tree dirty
    (repo / "benchmarks" / "study" / "results" / "r.json").write_text("[{}]\n")
    (repo / "README.md").write_text("# changed\n")
    assert records.commit_stamp()["dirty"] is False


def test_a_dirty_tree_is_refused_unless_allowed_and_then_marked(repo):
    (repo / "code.py").write_text("x = 2\n")
    with pytest.raises(records.DirtyTreeError, match="code.py.*--allow-dirty"):
        records.commit_stamp()
    stamp = records.commit_stamp(allow_dirty=True)
    assert stamp["dirty"] is True and len(stamp["git_commit"]) == 40
    assert records.stamped({"git_commit": None, "x": 1}, stamp) == {**stamp, "x": 1}


def test_outside_git_no_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "REPO", tmp_path)
    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    assert records.commit_stamp() == {"git_commit": None, "dirty": False}


def test_outside_git_the_commit_comes_from_the_environment_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "REPO", tmp_path)
    monkeypatch.setenv("BENCH_GIT_COMMIT", "a" * 40)
    assert records.commit_stamp() == {"git_commit": "a" * 40, "dirty": False, "commit_from": "BENCH_GIT_COMMIT"}


def test_in_a_checkout_the_environment_is_ignored(repo, monkeypatch):
    monkeypatch.setenv("BENCH_GIT_COMMIT", "a" * 40)
    assert records.commit_stamp()["git_commit"] != "a" * 40


@pytest.mark.parametrize("kept", [True, False])
def test_a_child_killed_after_its_measurement_keeps_its_record(tmp_path, kept):
    """A point written to disk before its teardown (teardown "not finished") keeps its numbers when the
    teardown is killed, with the kill in teardown_error; a point killed before it wrote anything gets
    the fallback record, with the kill as its error."""
    import sys

    from benchmarks.common.child import run_child

    result = tmp_path / "r.json"
    record = {"measured_step_s": 1.5, "error": None, "teardown": "not finished"}
    write = f"open({str(result)!r}, 'w').write(json.dumps({record!r})); " if kept else ""
    script = f"import json, os, signal; {write}os.kill(os.getpid(), signal.SIGKILL)"
    out = run_child([sys.executable, "-c", script], result, 60, {"measured_step_s": None, "error": None})
    assert out["child_exit_code"] == -9
    if kept:
        assert out["measured_step_s"] == 1.5 and out["error"] is None
        assert out["teardown_error"] == "killed by signal 9 (host out of memory?)"
    else:
        assert out["measured_step_s"] is None and out["error"] == "killed by signal 9 (host out of memory?)"
