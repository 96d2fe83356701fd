"""bench/_collectives.py: the scoreboard's count of a step's collective calls and of the bytes its
all-gathers gathered ([Note: one counter for eager hooks and compiled code]), on known collectives."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.train._collectives_ranks import count_known_collectives

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _collectives  # bench/ is not a package: its scripts import it the same way


def test_counts_every_call_and_the_bytes_all_gathers_gather(ranks2):
    counted = ranks2.run(count_known_collectives)
    # each all-gather's input bytes x 2 ranks: bf16 10 x 2 B, uint8 6 x 1 B, fp32 3 x 4 B; the all-reduce none
    assert [(c.calls, c.gathered_bytes) for c in counted] == [(4, 2 * (20 + 6 + 12))] * 2


def test_an_unknown_dtype_is_refused_by_name():
    assert _collectives.dtype_bytes("c10::Float8_e4m3fn") == 1
    with pytest.raises(ValueError, match="dtype 'c10::ComplexFloat'"):
        _collectives.dtype_bytes("c10::ComplexFloat")
