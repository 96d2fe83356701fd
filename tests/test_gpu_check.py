"""`python bench/gpu_check.py --cpu` end to end: the GPU check's code path at tiny shapes, so the script cannot rot.

Measures nothing (a CPU at tiny shapes); checks that every row of the table is produced: the gpu
tests' summary, the kernel rows, and a step time for each training configuration -- except torch's
overlap scheduler, which cannot run on a CPU and must fail with exactly that reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_gpu_check_cpu_path_prints_every_row():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=380, check=False
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    tests = rows["gpu tests (pytest -m gpu tests/gpu)"]
    assert ("skipped" if not torch.cuda.is_available() else "passed") in tests
    assert "failed" not in tests
    assert "error" not in tests
    kernels = [
        line for name, line in rows.items() if name.split(",")[0] in ("copy-in", "copy-out", "reduce-scatter copy-in")
    ]
    assert len(kernels) == 6
    assert all("GB/s" in line and "x FSDP2 eager" in line for line in kernels)
    for name in (
        "simplefsdp compiled, our passes",
        "simplefsdp compiled, no passes",
        "FSDP2 eager",
        "FSDP2 + compile per block",
    ):
        assert "ms / step" in rows[name], rows[name]
    overlap = rows["simplefsdp front end, torch's overlap scheduler"]
    assert "0 active drivers" in overlap or torch.cuda.is_available(), overlap
