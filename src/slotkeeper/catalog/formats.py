"""The small formats of `slotkeeper ls` and `prune`: durations, sizes, ages, paths and file names, counts, and
printing.

Sizes are read by pydantic's ByteSize, as --max-cache-bytes is, so that every size slotkeeper reads has one
syntax: `20GB`, `1.5G`, `8GiB`, `4096`. pydantic is imported only then: importing it costs `ls` 80 ms.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ByteSize, TypeAdapter

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d|day|days|w|wk|weeks?)\s*$", re.I)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CatalogError(Exception):
    """Bad input: its text is the whole one-line message."""


class RemoteFailure(CatalogError):
    """The shared tier failed the command (it could not be listed or reached): one line, and exit 1."""


def parse_duration(text: str) -> float:
    """Seconds from `90s`, `30m`/`30min`, `12h`, `7d`, `2w` (a unit is required)."""
    match = _DURATION.match(text)
    if not match:
        raise CatalogError(f"invalid duration {text!r}: use a number and a unit, e.g. 30min, 12h, 7d, 2w")
    unit = match.group(2).lower()
    unit = "m" if unit.startswith("m") else unit[0]
    return float(match.group(1)) * _DURATION_UNITS[unit]


def parse_size(text: str) -> int:
    """Bytes from `20GB`, `500MB`, `1.5G`, `20GiB`, `4096` (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    from pydantic import ValidationError

    try:
        return int(_byte_size().validate_python(text))
    except ValidationError:
        raise CatalogError(f"invalid size {text!r}: use e.g. 500MB, 20GB, 1.5TB, 8GiB or a byte count") from None


@functools.cache
def _byte_size() -> TypeAdapter[ByteSize]:
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize)


def format_age(seconds: float) -> str:
    """`12 s`, `3 min`, `2 h`, `5 d` (whole units, rounded down)."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    if seconds < 86400:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} d"


def display_path(path: str | os.PathLike[str]) -> str:
    """A path as people type it: the home directory as `~`."""
    text = os.fspath(path)
    home = _home(os.environ.get("HOME"))
    if home not in ("", "/") and (text == home or text.startswith(home + os.sep)):
        return "~" + text[len(home) :]
    return text


@functools.lru_cache(maxsize=8)
def _home(variable: str | None) -> str:
    """Path.home() (which reads $HOME, else the password database), once per value of $HOME: prune names the
    directory in each of thousands of lines."""
    return str(Path.home())


@functools.lru_cache(maxsize=256)
def file_name(path: str) -> str:
    """The model file's name (a store holds a few models and thousands of rows: pathlib once per model)."""
    return Path(path).name


def count(n: int, word: str, plural: str | None = None) -> str:
    """`1 entry`, `2 entries`, `1,024 slot files`."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def say(text: str) -> None:
    """print() that survives a closed pipe (`slotkeeper ls | head`): the rest of the output is dropped."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
