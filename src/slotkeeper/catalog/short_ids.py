"""Short ids: the shortest prefix of each row's id that tells it apart, as the table's first column and
prune's lines name entries.

Apart from the rows because it is a property of a whole listing (a save directory, or a namespace of the
shared tier), not of one row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ..chat.prefix import common_prefix
from .listed import Kind
from .local_rows import Row
from .remote_rows import RemoteRow

SHORT_ID_MIN = 4


def assign_short_ids(rows: Sequence[Row | RemoteRow]) -> None:
    """The shortest prefix of at least 4 hex digits (as the daemon's log lines name entries) that tells the
    rows apart; 8 suffice in practice.

    A row's prefix must be one character longer than the longest prefix its id shares with any other id (all of
    it, when that is the whole id). In sorted order, the id sharing the longest prefix with an id is one of its
    two neighbours, so one pass over the sorted distinct ids finds every row's length: O(n log n), where comparing
    every id with every other took minutes at tens of thousands of entries. Rows with the same id (an entry and
    its quarantined copy) do not tell each other apart, as before.
    """
    ids = sorted({r.id for r in rows if r.kind is not Kind.SLOT_FILE})
    shared = dict.fromkeys(ids, 0)  # id -> the longest prefix it shares with another id
    for left, right in itertools.pairwise(ids):
        n = common_prefix(left, right)
        if n > shared[left]:
            shared[left] = n
        if n > shared[right]:
            shared[right] = n
    for row in rows:
        if isinstance(row, Row) and row.kind is Kind.SLOT_FILE:
            row.short = row.name
            continue
        entry_id = row.id
        row.short = entry_id[: max(SHORT_ID_MIN, min(len(entry_id), shared[entry_id] + 1))]
