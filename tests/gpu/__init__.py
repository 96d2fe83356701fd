"""CUDA paths, `gpu`-marked: collected everywhere, skipped without CUDA; `pytest -m gpu -n 0` on a GPU machine.

Each module here mirrors CPU tests that check the same logic without a GPU (named in its docstring).
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["CUDA_ONLY"]

CUDA_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device: run `python -m pytest -m gpu -n 0` on a GPU machine"
    ),
]
