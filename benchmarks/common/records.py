"""Records: the git commit a run measured (a dirty tree refused unless --allow-dirty, and then marked),
the host, and the atomic rewrite of a JSON list of records."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Changes that do not change what is measured: the records and READMEs a run rewrites.
IGNORED_CHANGES = ("benchmarks/*/results/*", "*.md")


class DirtyTreeError(SystemExit):
    """The working tree has uncommitted changes and --allow-dirty was not given."""


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)


def changed_files() -> list[str] | None:
    """Tracked files with uncommitted changes, bar records and READMEs (None: not a git checkout)."""
    import fnmatch

    try:
        status = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    if status.returncode:
        return None
    paths = [line[3:].split(" -> ")[-1] for line in status.stdout.splitlines() if line.strip()]
    return [p for p in paths if not any(fnmatch.fnmatch(p, pat) for pat in IGNORED_CHANGES)]


def git_commit() -> str | None:
    """HEAD's full hash (None outside a git checkout)."""
    try:
        head = _git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() if head.returncode == 0 else None


def commit_stamp(allow_dirty: bool = False) -> dict:
    """{"git_commit": HEAD, "dirty": bool}, for every record of a run. A tree with uncommitted changes
    (records and READMEs aside) raises DirtyTreeError unless `allow_dirty`, and is then marked.
    Outside a git checkout (a copy of a clean checkout sent to a GPU machine), the commit is taken from
    BENCH_GIT_COMMIT and the record says so ("commit_from": "BENCH_GIT_COMMIT")."""
    if changed_files() is None and os.environ.get("BENCH_GIT_COMMIT"):
        return {"git_commit": os.environ["BENCH_GIT_COMMIT"], "dirty": False, "commit_from": "BENCH_GIT_COMMIT"}
    changed = changed_files()
    dirty = bool(changed)
    if dirty and not allow_dirty:
        raise DirtyTreeError(
            "uncommitted changes in " + ", ".join(changed[:8]) + (" ..." if len(changed) > 8 else "")
            + ": commit them first (a record names the commit it measured), or pass --allow-dirty "
              "(the records are then marked \"dirty\": true)")
    return {"git_commit": git_commit(), "dirty": dirty}


def add_allow_dirty(parser) -> None:
    """--allow-dirty, for every study's run.py: its records carry commit_stamp(args.allow_dirty)."""
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on a working tree with uncommitted changes (its records say \"dirty\": true)")


def host_description() -> dict:
    mem = None
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    return {"host_cpu": cpu, "host_cores": os.cpu_count(), "host_mem_bytes": mem}


def write_records(path: Path, records: list | dict) -> None:
    """Write `records` as JSON to `path` atomically (a killed run keeps the previous file whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(path)


def stamped(record: dict, stamp: dict) -> dict:
    """`record` with the run's commit stamp (and host) where it has none of its own."""
    record.update({k: v for k, v in stamp.items() if record.get(k) is None})
    return record
