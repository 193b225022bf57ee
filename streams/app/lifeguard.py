"""What keeps a worker honest when Kafka goes away: a broker watchdog, a stop deadline
and a limit on repeated log lines.

With the broker gone for good the worker used to log 17,412 ERROR lines in 150 s, say
``ready: true`` in a ``status.json`` 127 s old, and ignore SIGTERM (Faust's clean stop
waits for a broker that never answers). Here:

* :class:`BrokerWatch` asks the broker for its metadata every few seconds from a
  thread of its own (independent of Faust's event loop, which may be stuck); after
  ``exit_after_s`` without an answer it writes the status (``ready: false``, why) and
  exits the process with :data:`EXIT_BROKER_UNREACHABLE`, so a supervisor restarts it
  or pages someone instead of a worker that pretends to run; credentials the broker
  refuses end it at once with :data:`EXIT_CREDENTIALS_REFUSED` and librdkafka's reason;
* :func:`stop_deadline` starts, on SIGTERM/SIGINT, a timer that ends the process if
  the clean stop has not finished within ``grace_s``;
* :class:`RepeatFilter` lets the same log line through a few times per interval, then
  counts what it held back and says so once per interval.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from c4base.kafka import KafkaCredentialsError, credentials_refused

__all__ = [
    "EXIT_BROKER_UNREACHABLE",
    "EXIT_CREDENTIALS_REFUSED",
    "EXIT_STOP_TIMEOUT",
    "BrokerWatch",
    "RepeatFilter",
    "install_repeat_filter",
    "stop_deadline",
]

log = logging.getLogger(__name__)

EXIT_BROKER_UNREACHABLE = 3
EXIT_STOP_TIMEOUT = 4
EXIT_CREDENTIALS_REFUSED = 5

Probe = Callable[[float], None]
"""Raises if the broker did not answer within the timeout (seconds)."""


def kafka_probe(conf: dict[str, Any]) -> Probe:
    """A metadata request through confluent-kafka with the service's own settings
    (bootstrap, TLS, SASL): the same question a client asks first. Raises
    :class:`~c4base.kafka.KafkaCredentialsError` when the broker refused the credentials
    (SASL or TLS client certificate), which no wait can fix."""
    refused: list[KafkaError] = []

    def on_error(err: KafkaError) -> None:
        if credentials_refused(err):
            refused.append(err)

    # librdkafka's own log lines (a failed connect each retry) go through Python
    # logging, so the repeated-line limit applies to them too.
    admin = AdminClient(
        {**conf, "error_cb": on_error}, logger=logging.getLogger("c4stream.broker_watch")
    )

    def probe(timeout: float) -> None:
        try:
            md = admin.list_topics(timeout=timeout)
        except KafkaException:
            admin.poll(0)  # serves the error callback: was it our credentials?
            if refused:
                raise KafkaCredentialsError(
                    f"Kafka broker {conf.get('bootstrap.servers')} refused the worker's "
                    f"credentials: {refused[-1].str()}; check [kafka.extra] (sasl.*, ssl.*)"
                ) from None
            raise
        if not md.brokers:
            raise RuntimeError("no broker in the metadata")

    return probe


class BrokerWatch:
    """Probes the broker every ``every_s``; after ``exit_after_s`` of failures, calls
    ``on_lost(seconds)`` (default: exit the process with status 3).

    >>> fails = iter([True, True, True, True])
    >>> def probe(t):
    ...     if next(fails):
    ...         raise OSError("down")
    >>> now = iter([0.0, 5.0, 11.0]).__next__
    >>> lost = []
    >>> w = BrokerWatch(probe, exit_after_s=10, every_s=5, clock=now, on_lost=lost.append)
    >>> w.check(), w.check(), w.check(), lost
    (False, False, False, [11.0])
    """

    def __init__(
        self,
        probe: Probe,
        *,
        exit_after_s: float,
        every_s: float = 2.0,
        on_lost: Callable[[float], None] | None = None,
        on_change: Callable[[float | None], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.exit_after_s = exit_after_s
        self.every_s = every_s
        self.on_lost = on_lost or exit_broker_lost
        self.on_refused = on_refused or exit_credentials_refused
        self.on_change = on_change
        self.clock = clock
        self.down_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """One probe; True if the broker answered."""
        try:
            self.probe(max(1.0, min(self.every_s, 5.0)))
        except KafkaCredentialsError as err:
            self.on_refused(str(err))  # no wait: the same credentials are refused again
            return False
        except Exception as err:
            now = self.clock()
            if self.down_since is None:
                self.down_since = now
                log.error("broker unreachable: %s", err)
                if self.on_change:
                    self.on_change(self.down_since)
            elif now - self.down_since >= self.exit_after_s:
                self.on_lost(now - self.down_since)
            return False
        if self.down_since is not None:
            log.warning("broker reachable again after %.0fs", self.clock() - self.down_since)
            self.down_since = None
            if self.on_change:
                self.on_change(None)
        return True

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.every_s):
                self.check()

        self._thread = threading.Thread(target=loop, name="c4-broker-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def exit_broker_lost(seconds: float) -> None:
    log.critical("broker unreachable for %.0fs; exiting with status %d", seconds, 3)
    logging.shutdown()
    os._exit(EXIT_BROKER_UNREACHABLE)  # Faust's clean stop would wait for the broker


def exit_credentials_refused(why: str) -> None:
    log.critical("%s; exiting with status %d", why, EXIT_CREDENTIALS_REFUSED)
    logging.shutdown()
    os._exit(EXIT_CREDENTIALS_REFUSED)  # Faust's clean stop would wait for the broker


_deadline: list[threading.Timer] = []
"""The stop deadline once started (one per process)."""


def stop_deadline(grace_s: float, on_timeout: Callable[[], None] | None = None) -> threading.Timer:
    """Start a timer that ends the process if a requested stop takes over ``grace_s``
    (once: a second call returns the running timer)."""
    if _deadline:
        return _deadline[0]

    def expire() -> None:
        if on_timeout is not None:
            on_timeout()
        log.critical("clean stop took over %.0fs; exiting with status %d", grace_s, 4)
        logging.shutdown()
        os._exit(EXIT_STOP_TIMEOUT)

    t = threading.Timer(grace_s, expire)
    t.daemon = True
    t.start()
    _deadline.append(t)
    return t


def arm_on_signal(
    signums: Iterable[int], grace_s: float, on_timeout: Callable[[], None] | None = None
) -> None:
    """Start :func:`stop_deadline` the moment one of ``signums`` arrives, even while the
    event loop is busy in a long step: the Python-level handler runs between bytecodes
    of the main thread, whereas the loop's own handler (``add_signal_handler``, which
    keeps working through its wakeup fd) only runs once the step ends. Call after the
    loop's handlers are installed."""

    def handler(signum: int, frame: object) -> None:
        stop_deadline(grace_s, on_timeout)

    for s in signums:
        signal.signal(s, handler)


class RepeatFilter(logging.Filter):
    """At most ``burst`` records per (logger, level, message template) per ``every_s``;
    the first record after a quiet-down says how many were held back.

    >>> f = RepeatFilter(burst=2, every_s=60, clock=lambda: 0.0)
    >>> rec = lambda: logging.LogRecord("x", logging.ERROR, "", 0, "down %s", ("a",), None)
    >>> [f.filter(rec()) for _ in range(5)]
    [True, True, False, False, False]
    >>> f.clock = lambda: 61.0
    >>> r = rec(); f.filter(r), r.getMessage()
    (True, 'down a (3 similar lines held back in the last 60s)')
    """

    def __init__(
        self, burst: int = 5, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst = burst
        self.every_s = every_s
        self.clock = clock
        self._seen: dict[tuple[str, int, str], list[float]] = {}
        """key -> [window start, passed, held back]."""
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = self.clock()
        with self._lock:
            st = self._seen.get(key)
            if st is None or now - st[0] >= self.every_s:
                held = int(st[2]) if st is not None else 0
                self._seen[key] = [now, 1, 0]
                if len(self._seen) > 10_000:  # bounded: forget the oldest keys
                    for k in list(self._seen)[:5_000]:
                        self._seen.pop(k, None)
                if held:
                    record.msg = (
                        f"{record.msg} ({held} similar lines held back in the last "
                        f"{self.every_s:.0f}s)"
                    )
                return True
            if st[1] < self.burst:
                st[1] += 1
                return True
            st[2] += 1
            return False


def install_repeat_filter(flt: RepeatFilter | None = None) -> RepeatFilter:
    """Attach one :class:`RepeatFilter` to every handler of the root logger."""
    flt = flt or RepeatFilter()
    for h in logging.getLogger().handlers:
        if flt not in h.filters:
            h.addFilter(flt)
    return flt
