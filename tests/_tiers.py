"""The fast tier: `python -m pytest -m "not slow"` (see the README's Tests section).

A test is marked `slow` when it costs tens of seconds and a cheaper sibling in the fast tier runs the
same code: the other strategies, backends or world sizes of a parametrized test, 4-rank runs,
world-64 compiles, end-to-end runs of the commands in subprocesses, the fault tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

__all__ = ["fast_first"]


def fast_first(values: Iterable[Any], *, fast: int = 1, rows: bool = False) -> list[Any]:
    """`values` for `pytest.mark.parametrize`: the first `fast` in the fast tier, the others marked
    slow. `rows=True` when each value is a tuple holding one value per argument name."""
    return [
        value if i < fast else pytest.param(*(value if rows else (value,)), marks=pytest.mark.slow)
        for i, value in enumerate(values)
    ]
