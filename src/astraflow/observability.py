"""Logging set-up, called once by the CLI (library modules never configure logging).

Log lines carry ``key=value`` context (``node=… policy=… version=…``) in the message itself, so
text logs grep well and the JSON format keeps the same words.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal

__all__ = ["LOG_LEVELS", "setup_logging"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# Libraries that are chatty at INFO and say nothing a user of astraflow needs.
_QUIET = (
    "httpx",
    "httpx2",
    "openai",
    "httpcore",
    "uvicorn.access",
    "urllib3",
    "filelock",
    "asyncio",
)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body)


def setup_logging(
    level: str = "INFO", fmt: Literal["text", "json"] = "text", component: str = ""
) -> None:
    """Configure the root logger once for this process (stderr, text or JSON lines)."""
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        prefix = f"{component} " if component else ""
        formatter = logging.Formatter(
            f"%(asctime)s.%(msecs)03d %(levelname).1s {prefix}%(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
