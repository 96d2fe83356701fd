"""The package's data stay true as the code changes.

- Every value of every named device profile in the cost model's data file says where it comes from.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from simplefsdp.passes import cost

ROOT = Path(__file__).resolve().parents[1]


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
