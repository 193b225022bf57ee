"""What keeps a Kafka service honest when the broker goes away or a stop is asked for:
one home for the worker and the sinks.

With the broker gone for good the worker used to log 17,412 ERROR lines in 150 s, say
``ready: true`` in a ``status.json`` 127 s old, and ignore SIGTERM (Faust's clean stop
waits for a broker that never answers). Here:

* :class:`Outage` — since when the broker has not answered and whether that is longer
  than the service waits: the sinks' loop (:class:`~c4base.runtime.ConsumerRunner`,
  which asks from its own loop) and the worker's :class:`BrokerWatch` both judge by it;
* :class:`BrokerWatch` asks the broker for its metadata every few seconds from a
  thread of its own (independent of Faust's event loop, which may be stuck); after
  ``exit_after_s`` without an answer it writes the status (``ready: false``, why) and
  exits the process with :data:`EXIT_BROKER_UNREACHABLE`, so a supervisor restarts it
  or pages someone instead of a worker that pretends to run; credentials the broker
  refuses end it at once with :data:`EXIT_CREDENTIALS_REFUSED` and librdkafka's reason;
* :func:`stop_on_signals` (a sink: SIGTERM/SIGINT set its stop event) and
  :func:`stop_deadline` / :func:`arm_on_signal` (the worker: on SIGTERM/SIGINT a timer
  ends the process if the clean stop has not finished within ``grace_s``);
* :func:`write_status` — the status file, replaced atomically.

The limit on repeated log lines is :mod:`c4base.throttle`.
"""

from __future__ import annotations

import json
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
    "EXIT_FATAL",
    "EXIT_CREDENTIALS_REFUSED",
    "EXIT_STOP_TIMEOUT",
    "BrokerWatch",
    "Outage",
    "arm_on_signal",
    "stop_deadline",
    "stop_on_signals",
    "write_status",
]

log = logging.getLogger(__name__)

EXIT_FATAL = 1
"""The service cannot go on (as a sink's ``FatalError``); nothing past was committed."""
EXIT_BROKER_UNREACHABLE = 3
EXIT_STOP_TIMEOUT = 4
EXIT_CREDENTIALS_REFUSED = 5

Probe = Callable[[float], None]
"""Raises if the broker did not answer within the timeout (seconds)."""


class Outage:
    """Since when the broker has not answered, and whether that is too long.

    >>> o = Outage(limit_s=10)
    >>> o.failed(0.0), o.failed(5.0), o.too_long(9.0), o.too_long(10.0)
    (True, False, None, 10.0)
    >>> o.answered(12.0), o.answered(13.0), o.since
    (12.0, None, None)
    """

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s
        """None: wait for ever."""
        self.since: float | None = None

    def failed(self, now: float) -> bool:
        """No answer at ``now``; True if that starts an outage."""
        if self.since is None:
            self.since = now
            return True
        return False

    def answered(self, now: float) -> float | None:
        """An answer at ``now``; how long the outage it ends lasted (None: none)."""
        since, self.since = self.since, None
        return None if since is None else now - since

    def too_long(self, now: float) -> float | None:
        """Seconds of outage when they reach the limit, else None."""
        if self.since is None or self.limit_s is None or now - self.since < self.limit_s:
            return None
        return now - self.since


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
        self.outage = Outage(exit_after_s)
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
            if self.outage.failed(now):
                log.error("broker unreachable: %s", err)
                if self.on_change:
                    self.on_change(now)
            elif (down := self.outage.too_long(now)) is not None:
                self.on_lost(down)
            return False
        down = self.outage.answered(self.clock())
        if down is not None:
            log.warning("broker reachable again after %.0fs", down)
            if self.on_change:
                self.on_change(None)
        return True

    @property
    def down_since(self) -> float | None:
        return self.outage.since

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


def exit_fatal(why: str) -> None:
    log.critical("%s; exiting with status %d", why, EXIT_FATAL)
    logging.shutdown()
    os._exit(EXIT_FATAL)  # now: a clean stop would commit what was not handled


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


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: a sink's loop finishes the record at hand,
    commits what is durable and leaves its group (it answers within a poll timeout)."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())


def write_status(path: Any, status: dict[str, Any]) -> None:
    """Atomically replace the status file (readers never see half a file); the worker's
    broker watchdog writes from its own thread, hence a temp name per thread."""
    tmp = f"{path}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)
