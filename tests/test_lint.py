"""ruff (lint and format, configured in pyproject.toml) is clean over the whole repository."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(command):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is part of the dev extra: pip install -e '.[dev]'"
    result = subprocess.run([ruff, *command], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
