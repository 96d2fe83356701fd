"""The terminal tables of `simplefsdp inspect`, readable at 80 columns: a cell too wide wraps onto
more lines (never cut short with "..."), and the columns of least use are left out unless `--wide`
asks for every column, each at its full width. Only the columns of prose wrap (`Column.wrap`, at
spaces); names and numbers keep their width, so an 80-column table does not split "SHARD_GRAD_OP".

    table("buckets", [Column("id", right=True), Column("elements", right=True, wide=True)], rows, wide=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = ["Column", "console", "table"]

_PROSE_MIN = 9  # characters a wrapping column keeps at 80 columns
_UNLIMITED = 10_000  # columns of a `--wide` console: every table as wide as its widest row


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    right: bool = False  # right-justified (numbers)
    wide: bool = False  # shown only with --wide
    wrap: bool = False  # text that may wrap at its spaces; the other columns keep their width


def table(
    title: str, columns: Sequence[Column], rows: Iterable[Sequence[str]], *, wide: bool, show_header: bool = True
) -> Table:
    """A table of `rows` (one string per column of `columns`) showing the columns `wide` selects."""
    shown = [i for i, column in enumerate(columns) if wide or not column.wide]
    # rules under the title and the header only, no vertical bars: two columns of text per table
    # column that a boxed table spends on borders go to the cells, so fewer of them wrap
    out = Table(title=title, show_header=show_header, box=box.SIMPLE_HEAD, pad_edge=False, padding=0)
    for i in shown:
        column = columns[i]
        justify = "right" if column.right else "left"
        # a prose column keeps room for a word or two; the others keep their width unless nothing else gives
        min_width = _PROSE_MIN if column.wrap and not wide else None
        out.add_column(column.name, justify=justify, overflow="fold", no_wrap=not column.wrap, min_width=min_width)
    for row in rows:
        out.add_row(*(row[i] for i in shown))
    return out


def console(*, wide: bool) -> Console:
    """The terminal's console, or with `wide` one without a width limit (lines as long as they are)."""
    return Console(width=_UNLIMITED) if wide else Console()
