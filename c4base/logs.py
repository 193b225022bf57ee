"""Structured logging: one JSON object per line (for log shippers) or plain text.

>>> import io, json, logging
>>> buf = io.StringIO()
>>> log = setup_logging("INFO", json_lines=True, stream=buf, name="c4stream.doctest")
>>> log.info("isolated", extra={"host": "node-003", "fault": "straggler"})
>>> rec = json.loads(buf.getvalue())
>>> rec["msg"], rec["host"], rec["level"]
('isolated', 'node-003', 'info')
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

__all__ = ["JsonFormatter", "setup_logging"]

# Attributes every LogRecord has; anything else came in through ``extra=`` and is data.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(
    level: str = "INFO",
    *,
    json_lines: bool = False,
    stream: IO[str] | None = None,
    name: str = "c4stream",
) -> logging.Logger:
    """Configure the ``c4stream`` logger tree once per process and return it."""
    logger = logging.getLogger(name)
    logger.setLevel(level.upper())
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if json_lines
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logger.handlers[:] = [handler]
    logger.propagate = False
    return logger
