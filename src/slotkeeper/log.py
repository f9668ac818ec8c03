"""One line per event on stderr, readable among llama-server's own lines in llama-swap's log view."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

LOGGER_NAME = "slotkeeper"
log = logging.getLogger(LOGGER_NAME)
# Router mode: the model the work in this context is for (set where a request or a save for it starts, and
# inherited by the tasks that work starts); its lines read `model qwen: chat 3f2a restored ...`.
MODEL = contextvars.ContextVar("slotkeeper_model", default="")


def _with_model(message: str) -> str:
    model = MODEL.get()
    return f"model {model}: {message}" if model else message


def _traceback(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The traceback a call with `exc_info` asked for (only ever with --log-level debug: one line per event
    otherwise)."""
    if record.exc_info and log.isEnabledFor(logging.DEBUG):
        return formatter.formatException(record.exc_info)
    return None


class PlainFormatter(logging.Formatter):
    """`slotkeeper: slot 0 restored: ...`, with the level named only when it is not plain info (in debug, a
    traceback asked for follows on its own lines)."""

    def format(self, record: logging.LogRecord) -> str:
        message = _with_model(record.getMessage().replace("\n", " "))
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        line = f"slotkeeper: {level}{message}"
        trace = _traceback(self, record)
        return f"{line}\n{trace}" if trace else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line for log shippers (in debug, a traceback asked for is its "exc")."""

    def format(self, record: logging.LogRecord) -> str:
        trace = _traceback(self, record)
        return json.dumps(
            {
                "ts": round(time.time(), 3),
                "level": record.levelname.lower(),
                "logger": LOGGER_NAME,
                "msg": record.getMessage(),
                **({"model": MODEL.get()} if MODEL.get() else {}),
                **({"exc": trace} if trace else {}),
            },
            ensure_ascii=False,
        )


def setup_logging(level: str = "info", fmt: str = "plain") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


def fmt_bytes(n: int) -> str:
    """Sizes the way people read them in a log: `31.1 MB`, `1.2 GB`."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"  # pragma: no cover


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def describe_error(exc: BaseException) -> str:
    """An unexpected error in a few words for its one log line: `[Errno 30] Read-only file system`,
    `KeyError: 'id'` (an OSError says what it is; other errors need their type to mean anything)."""
    text = str(exc)
    if isinstance(exc, OSError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
