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


class PlainFormatter(logging.Formatter):
    """`slotkeeper: slot 0 restored: ...`, with the level named only when it is not plain info."""

    def format(self, record: logging.LogRecord) -> str:
        message = _with_model(record.getMessage().replace("\n", " "))
        if record.levelno == logging.INFO:
            return f"slotkeeper: {message}"
        return f"slotkeeper: {record.levelname.lower()}: {message}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": round(time.time(), 3),
                "level": record.levelname.lower(),
                "logger": LOGGER_NAME,
                "msg": record.getMessage(),
                **({"model": MODEL.get()} if MODEL.get() else {}),
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
