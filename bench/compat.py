"""The Hugging Face integration's tests in this environment, with the versions they ran on.

    python bench/compat.py                 # run by each environment's own python: one table row

Runs `TESTS` (the Trainer end to end and its refusals, `simplefsdp train --model`, `from_accelerate`,
fp16 loss scaling, foreign models) under pytest, slow tier included, and prints one markdown row:
the versions of python, torch, transformers, accelerate, tokenizers, huggingface-hub and NumPy, then
pytest's summary and the wall time. `bench/results/compat_runs.md` records it at each end of the
`hf` extra's range in pyproject.toml. Exit code: pytest's.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = (
    "tests/hf",
    "tests/train/test_hf_model.py",
    "tests/train/test_fp16.py",
    "tests/simplefsdp/test_accelerate_config.py",
    "tests/simplefsdp/test_loss_scaling.py",
    "tests/inspect/test_foreign_models.py",
)
PACKAGES = ("torch", "transformers", "accelerate", "tokenizers", "huggingface-hub", "numpy")


def versions() -> list[str]:
    """python's version, then each of `PACKAGES`' ("-" when not installed)."""
    found = [platform.python_version()]
    for name in PACKAGES:
        try:
            found.append(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            found.append("-")
    return found


def main() -> int:
    began = time.perf_counter()
    command = [sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - began
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else f"no output (exit code {done.returncode})"
    print("| python | " + " | ".join(PACKAGES) + " | result | seconds |")
    print("|---" * (len(PACKAGES) + 3) + "|")
    print(f"| {' | '.join(versions())} | {summary} | {seconds:.0f} |")
    if done.returncode:
        print(done.stdout[-4000:] + done.stderr[-2000:], file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
