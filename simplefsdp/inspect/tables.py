"""The terminal tables of `simplefsdp inspect`, readable at 80 columns: a cell too wide wraps onto
more lines (never cut short with "..."), and the columns of least use are left out unless `--wide`
asks for every column, each at its full width.

    table("buckets", [Column("id", right=True), Column("elements", right=True, wide=True)], rows, wide=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.table import Table

__all__ = ["Column", "console", "table"]

_UNLIMITED = 10_000  # columns of a `--wide` console: every table as wide as its widest row


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    right: bool = False  # right-justified (numbers)
    wide: bool = False  # shown only with --wide


def table(
    title: str, columns: Sequence[Column], rows: Iterable[Sequence[str]], *, wide: bool, show_header: bool = True
) -> Table:
    """A table of `rows` (one string per column of `columns`) showing the columns `wide` selects."""
    shown = [i for i, column in enumerate(columns) if wide or not column.wide]
    out = Table(title=title, show_header=show_header)
    for i in shown:
        out.add_column(columns[i].name, justify="right" if columns[i].right else "left", overflow="fold")
    for row in rows:
        out.add_row(*(row[i] for i in shown))
    return out


def console(*, wide: bool) -> Console:
    """The terminal's console, or with `wide` one without a width limit (lines as long as they are)."""
    return Console(width=_UNLIMITED) if wide else Console()
