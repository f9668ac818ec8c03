"""`slotkeeper ls`'s table text: one table per save directory (or per namespace of the shared tier), all on the
same columns so that they read as one listing, each followed by its summary line, then the total.

When some row is kept as blocks, an `own` column follows `size`: what only that row holds on disk (an entry
kept as blocks shares some with other entries; a .bin is its own). Without one the table is as it always was.

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

HEADERS = ("entry", "tokens", "size", "own", "last used", "model", "status", "match")
NUMBERS = frozenset({"tokens", "size", "own", "last used"})  # right-aligned
OWN = "own"  # only when some row is kept as blocks
MATCH = "match"  # only with llama-server arguments to match
BUDGETS = {"status": 38, "match": 40}  # longer texts in the last columns overflow instead of squeezing the model

Section = tuple[str, Sequence[Listed], str]  # title, rows, summary line


def headers_for(rows: Sequence[Listed], expectation: Expectation | None) -> list[str]:
    """HEADERS, without `own` when no row is kept as blocks and without `match` when nothing is matched."""
    own = any(row.in_blocks for row in rows)
    return [h for h in HEADERS if (h != OWN or own) and (h != MATCH or expectation)]


def table_row(row: Listed, now: float, expectation: Expectation | None, *, own: bool = False) -> list[str]:
    """A row's cells in HEADERS' order; the own column with `own`, the match column only with llama-server
    arguments to match."""
    tokens, size, held = row.tokens, row.size, row.own_bytes
    cells = [
        row.label_id,
        f"{tokens:,}" if tokens is not None else "-",
        fmt_bytes(size) if size is not None else "-",
        *([fmt_bytes(held) if held is not None else "-"] if own else []),
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
    headers = headers_for([r for _, rows, _ in sections for r in rows], expectation)
    own = OWN in headers
    tables = [[table_row(r, now, expectation, own=own) for r in rows] for _, rows, _ in sections]
    widths = fit(headers, [row for rows in tables for row in rows], headers.index("model"), BUDGETS)
    right = {i for i, header in enumerate(headers) if header in NUMBERS}
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
            lines += [format_row(row, widths, right) for row in [headers, *rows]]
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
