"""The one limit on repeated log lines, for the sinks' loop, librdkafka and the worker.

A broker that is down makes every client say the same thing many times a second (the
worker once logged 17,412 ERROR lines in 150 s). :class:`LogThrottle` lets ``burst``
lines per key through per window of ``interval_s``; the first line of the next window
says how many were held back. It is used three ways:

* :meth:`LogThrottle.log` — a loop's own repeated lines (retries, commit failures);
* :func:`kafka_logger` — a logger for librdkafka's lines (a client's ``logger``
  setting), one line per template per interval;
* :class:`RepeatFilter` on every handler of the root logger (the Faust worker, whose
  lines come from Faust, aiokafka and our agents alike), a few lines per template.

>>> t = LogThrottle(interval_s=10.0, clock=iter([0.0, 1.0, 2.0, 11.0]).__next__)
>>> [t.allow("down") for _ in range(4)]
[(True, 0), (False, 0), (False, 0), (True, 2)]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LogThrottle", "RepeatFilter", "install_repeat_filter", "kafka_logger"]


class LogThrottle:
    """At most ``burst`` lines per key per ``interval_s``; the next one says how many
    were held (:meth:`allow`). Thread-safe; remembers at most ``max_keys`` keys."""

    def __init__(
        self,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        burst: int = 1,
        max_keys: int = 10_000,
    ) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self._seen: dict[Hashable, list[float]] = {}
        """key -> [window start, passed, held back]."""
        self._lock = threading.Lock()

    def allow(self, key: Hashable) -> tuple[bool, int]:
        """(log it now?, lines held back in the window before, when it opens one)."""
        now = self.clock()
        with self._lock:
            st = self._seen.get(key)
            if st is None or now - st[0] >= self.interval_s:
                held = int(st[2]) if st is not None else 0
                self._seen[key] = [now, 1, 0]
                if len(self._seen) > self.max_keys:  # bounded: forget the oldest keys
                    for k in list(self._seen)[: self.max_keys // 2]:
                        self._seen.pop(k, None)
                return True, held
            if st[1] < self.burst:
                st[1] += 1
                return True, 0
            st[2] += 1
            return False, 0

    def note(self, held: int) -> str:
        """What a line that opens a window says about the ones held before it."""
        return f" ({held} similar line(s) held back in the last {self.interval_s:.0f}s)"

    def log(self, logger: logging.Logger, level: int, key: str, msg: str, *args: Any) -> None:
        ok, held = self.allow(key)
        if ok:
            logger.log(level, msg + (self.note(held) if held else ""), *args)


class RepeatFilter(logging.Filter):
    """A :class:`LogThrottle` as a logging filter, keyed on (logger, level, message
    template); records below ``min_level`` always pass.

    >>> f = RepeatFilter(burst=2, every_s=60, clock=lambda: 0.0)
    >>> rec = lambda: logging.LogRecord("x", logging.ERROR, "", 0, "down %s", ("a",), None)
    >>> [f.filter(rec()) for _ in range(5)]
    [True, True, False, False, False]
    >>> f.throttle.clock = lambda: 61.0
    >>> r = rec(); f.filter(r), r.getMessage()
    (True, 'down a (3 similar line(s) held back in the last 60s)')
    """

    def __init__(
        self,
        burst: int = 5,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        key_chars: int = 200,
        min_level: int = logging.WARNING,
    ) -> None:
        super().__init__()
        self.throttle = LogThrottle(every_s, clock, burst=burst)
        self.key_chars = key_chars
        self.min_level = min_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return True
        ok, held = self.throttle.allow(
            (record.name, record.levelno, str(record.msg)[: self.key_chars])
        )
        if ok and held:
            record.msg = f"{record.msg}{self.throttle.note(held)}"
        return ok


def install_repeat_filter(flt: RepeatFilter | None = None) -> RepeatFilter:
    """Attach one :class:`RepeatFilter` to every handler of the root logger."""
    flt = flt or RepeatFilter()
    for h in logging.getLogger().handlers:
        if flt not in h.filters:
            h.addFilter(flt)
    return flt


def kafka_logger(stage: str, every_s: float = 30.0) -> logging.Logger:
    """A logger for librdkafka's own lines (a client's ``logger`` setting) that lets the
    same line through at most every ``every_s``: a broker that is down must not flood.
    librdkafka's lines carry the broker address and a counter: the key is the head of
    the template (its facility)."""
    logger = logging.getLogger(f"c4base.runtime.rdkafka.{stage}")
    if not any(isinstance(f, RepeatFilter) for f in logger.filters):
        logger.addFilter(RepeatFilter(1, every_s, key_chars=40, min_level=logging.NOTSET))
    return logger
