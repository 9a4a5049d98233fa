"""The generated parts of the benchmark READMEs are what benchmarks/make_readme.py makes of the
committed records (so they are never edited by hand), and benchmarks/ holds no sitting-named files."""

import re
from pathlib import Path

from benchmarks import make_readme

BENCHMARKS = Path(make_readme.__file__).resolve().parent


def test_readmes_are_generated_from_the_records():
    stale = [str(p.relative_to(BENCHMARKS)) for p, text in make_readme.expected().items() if p.read_text() != text]
    assert not stale, f"run python benchmarks/make_readme.py: {stale}"


def test_every_study_is_listed_and_its_records_are_dated():
    studies = {p.parent.name for p in BENCHMARKS.glob("*/results")}
    assert {p.parent.name for p in BENCHMARKS.glob("*/run.py")} <= studies == set(make_readme.STUDIES)
    for study in studies:
        for record in (BENCHMARKS / study / "results").glob("*"):
            assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9.-]+\.json", record.name), record


def test_no_bulk_plans_traces_or_pickles():
    files = [p for p in BENCHMARKS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert not [p for p in files if p.suffix in (".pickle", ".gz", ".pkl")]
    assert len([p for p in files if "plan" in p.name and p.suffix == ".json"]) <= 1
