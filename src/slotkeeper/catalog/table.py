"""A tiny table renderer: cells padded to their column, numbers right-aligned, two spaces apart.

Ours rather than a library's because `ls` wants what table libraries do not do together: every directory's
table on the same column positions, a 100-column budget met by cutting the middle out of the model column
only (its end, the quantization, stays readable), and plain text with no trailing blanks that scripts and
tests can split on runs of two spaces. It is some forty lines; a dependency would be more.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

WIDTH = 100  # the model column is shortened (not below MODEL_MIN) to keep lines within this
MODEL_MIN = 20


def shorten(text: str, width: int) -> str:
    """Cut the middle out of a long name, keeping its end (the quantization and extension) readable."""
    if len(text) <= width:
        return text
    keep_end = (width - 1) // 2
    return text[: width - 1 - keep_end] + "…" + text[len(text) - keep_end :]


def column_widths(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[int]:
    return [max(len(cell) for cell in column) for column in zip(headers, *rows)]


def format_row(row: Sequence[str], widths: Sequence[int], right: Container[int], indent: str = "  ") -> str:
    """Cells padded to their column (numbers right-aligned), two spaces apart, no trailing blanks."""
    cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
    return (indent + "  ".join(cells)).rstrip()


def fit(headers: Sequence[str], rows: list[list[str]], squeeze: int, budgets: Mapping[str, int]) -> list[int]:
    """Column widths for `rows` (changed in place) within WIDTH: the `squeeze` column's texts lose `.gguf`,
    then their middles. Columns in `budgets` count at most that wide: a long text there (the last columns)
    overflows rather than squeezing further."""

    def overflow(widths: list[int]) -> int:
        budget = [min(w, budgets[h]) if h in budgets else w for h, w in zip(headers, widths)]
        return 2 + sum(budget) + 2 * (len(budget) - 1) - WIDTH

    widths = column_widths(headers, rows)
    if overflow(widths) > 0:
        for row in rows:
            row[squeeze] = row[squeeze].removesuffix(".gguf")
        widths = column_widths(headers, rows)
    if overflow(widths) > 0 and widths[squeeze] > MODEL_MIN:
        widths[squeeze] = max(MODEL_MIN, widths[squeeze] - overflow(widths))
        for row in rows:
            row[squeeze] = shorten(row[squeeze], widths[squeeze])
    return widths
