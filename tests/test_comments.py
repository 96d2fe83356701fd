"""The package's comments and data stay true as the code changes.

- No dates or host descriptions in the package's code (`simplefsdp/`, `passes/`, `kernels/`): a
  comment says what the code does and why; a number chosen from a measurement cites the result record
  under `bench/results/` that holds it, where the run's date and host live.
- A note that cites `bench/results/measurements.md` names a section that is there.
- Every value of every named device profile in the cost model's data file says where it comes from.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from simplefsdp.passes import cost

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("simplefsdp", "passes", "kernels")
# A date (YYYY-MM-DD) or a description of the machine a number was measured on.
FORBIDDEN = re.compile(
    r"\b20\d\d-[01]\d-[0-3]\d\b|\bAMD EPYC\b|\bXeon\b|\bdevelopment (?:host|machine)\b|\b\d+-core host\b",
    re.IGNORECASE,
)


def _package_files() -> list[Path]:
    files = sorted(path for folder in PACKAGE_DIRS for path in (ROOT / folder).rglob("*.py"))
    assert files, f"no .py files under {PACKAGE_DIRS} in {ROOT}"
    return files


def forbidden_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of `text` holding a date or a host description."""
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if FORBIDDEN.search(line)]


@pytest.mark.parametrize(
    "line",
    [
        "# measured 2026-12-04",
        "Measured on a 2-core AMD EPYC host",
        "on a Xeon",
        "the development host",
        "on the 2-core host",
    ],
)
def test_pattern_catches(line):
    assert forbidden_lines(line), line


@pytest.mark.parametrize("line", ["# 16 MiB on 8 ranks", "host memory (pinned)", "NVIDIA H100 SXM datasheet"])
def test_pattern_spares(line):
    assert not forbidden_lines(line), line


def test_package_code_has_no_dates_or_hosts():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in _package_files()
        for number, line in forbidden_lines(path.read_text())
    ]
    assert not found, "dates / hosts belong in bench/results/, not the code:\n" + "\n".join(found)


MEASUREMENTS = ROOT / "bench" / "results" / "measurements.md"
# `(bench/results/measurements.md, "section")`, wrapped across comment lines or not
CITATION = re.compile(r'measurements\.md,? \(?"([^"]+)"')


def test_cited_measurements_exist():
    """Each section a note cites is a heading of the record, and each heading is cited somewhere."""
    headings = [line[3:].lower() for line in MEASUREMENTS.read_text().splitlines() if line.startswith("## ")]
    cited = {}
    for path in _package_files():
        text = " ".join(line.strip().lstrip("#").strip() for line in path.read_text().splitlines())
        for match in CITATION.finditer(text):
            cited.setdefault(match.group(1).lower(), []).append(str(path.relative_to(ROOT)))
    assert cited, "no note cites bench/results/measurements.md"
    missing = {name: files for name, files in cited.items() if not any(h.startswith(name) for h in headings)}
    assert not missing, f"cited but no such section in {MEASUREMENTS.name}: {missing}"
    uncited = [h for h in headings if not any(h.startswith(name) for name in cited)]
    assert not uncited, f"sections of {MEASUREMENTS.name} that no note cites: {uncited}"


def test_every_profile_value_has_a_source():
    """`passes/profiles.toml`: each field of each named profile is `{ value, source }` with a source
    that says something, and the file holds exactly the profiles `cost.PROFILES` offers."""
    document = tomllib.loads(cost.PROFILES_FILE.read_text())
    assert set(document) == set(cost.PROFILES)
    unsourced = [
        f"[{name}] {key}"
        for name, table in document.items()
        for key, entry in table.items()
        if not (isinstance(entry, dict) and "value" in entry and str(entry.get("source", "")).strip())
    ]
    assert not unsourced, f"values without a source in {cost.PROFILES_FILE.name}: {unsourced}"


def test_profiles_file_is_package_data():
    """A non-editable install ships the profiles file: pyproject.toml declares it package data."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    assert cost.PROFILES_FILE.name in package_data["simplefsdp.passes"]
    assert cost.PROFILES_FILE.parent == ROOT / "passes"
