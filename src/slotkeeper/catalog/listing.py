"""`slotkeeper ls`'s table text: one table per save directory (or per namespace of the shared tier), all on the
same columns so that they read as one listing, each followed by its summary line, then the total.

What the summary lines say is summaries'; how columns are padded and squeezed to 100 columns is table's.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from ..log import fmt_bytes
from .formats import display_path, file_name, format_age
from .listed import Listed
from .match import Expectation
from .remote_rows import RemoteRow
from .scan import SaveDir
from .statuses import COMPARABLE
from .summaries import dir_summary, dirs_total, namespace_summary, namespaces_total
from .table import WIDTH, fit, format_row

HEADERS = ("entry", "tokens", "size", "last used", "model", "status", "match")
RIGHT_ALIGNED = (1, 2, 3)
MODEL_COLUMN = 4
BUDGETS = {"status": 38, "match": 40}  # longer texts in the last columns overflow instead of squeezing the model

Section = tuple[str, Sequence[Listed], str]  # title, rows, summary line


def table_row(row: Listed, now: float, expectation: Expectation | None) -> list[str]:
    """A row's cells in HEADERS' order; the match column only with llama-server arguments to match."""
    tokens, size = row.tokens, row.size
    cells = [
        row.label_id,
        f"{tokens:,}" if tokens is not None else "-",
        fmt_bytes(size) if size is not None else "-",
        format_age(now - row.last_used) + " ago",
        file_name(row.model) if row.model else "-",
        row.detail,
    ]
    if expectation:
        if row.status not in COMPARABLE:
            cells.append("-")  # the status column says why it is never used
        else:
            differences = expectation.differences(row.fingerprint)
            cells.append("no: " + differences[0] if differences else "yes")
    return cells


def render_sections(sections: Sequence[Section], total: str | None, now: float, expectation: Expectation | None) -> str:
    """Tables (title, rows, summary line) sharing their columns, then the total line."""
    headers = list(HEADERS if expectation else HEADERS[:-1])
    tables = [[table_row(r, now, expectation) for r in rows] for _, rows, _ in sections]
    widths = fit(headers, [row for rows in tables for row in rows], MODEL_COLUMN, BUDGETS)
    lines: list[str] = []
    if expectation:
        lines += textwrap.wrap(
            f"match: {expectation.checked()}",
            WIDTH,
            subsequent_indent="       ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        lines.append("")
    for i, ((title, _, summary), rows) in enumerate(zip(sections, tables)):
        if i:
            lines.append("")
        lines.append(title)
        if rows:
            lines += [format_row(row, widths, RIGHT_ALIGNED) for row in [headers, *rows]]
        else:
            lines.append("  (no entries)")
        lines += textwrap.wrap(
            summary,
            WIDTH,
            initial_indent="  ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    if total:
        lines += ["", total]
    return "\n".join(lines)


def render_listing(dirs: Sequence[SaveDir], now: float, expectation: Expectation | None) -> str:
    """One table per directory, all with the same columns, so the directories read as one listing."""
    sections = [(display_path(d.path), d.rows, dir_summary(d)) for d in dirs]
    return render_sections(sections, dirs_total(dirs), now, expectation)


def render_remote(
    url: str, by_namespace: Mapping[str, list[RemoteRow]], now: float, expectation: Expectation | None
) -> str:
    """One table per namespace of the shared tier, on the same columns as the save directories'."""
    if not by_namespace:
        return f"no entries in {url}"
    sections: list[Section] = [
        (f"{url}/{namespace}", rows, namespace_summary(rows)) for namespace, rows in by_namespace.items()
    ]
    return render_sections(sections, namespaces_total(by_namespace), now, expectation)
