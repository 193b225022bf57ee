"""Classified failures: what a service's code raises to tell its loop what to do.

Each failure is classified where it happens (STYLE.md habit 9); the loop around it acts
on the class alone. The sinks' :class:`~c4base.runtime.ConsumerRunner` acts on them as
its module docstring says; the Faust worker's exits (broker gone, credentials refused,
stop overdue) carry the exit statuses of :mod:`c4base.lifeguard`.

>>> issubclass(BrokerUnreachable, FatalError), issubclass(Rewind, TransientError)
(True, True)
"""

from __future__ import annotations

__all__ = [
    "TP",
    "BrokerUnreachable",
    "CredentialsRefused",
    "DeadLetterError",
    "FatalError",
    "PermanentError",
    "Rewind",
    "TransientError",
]

TP = tuple[str, int]
"""(topic, partition)."""


class TransientError(Exception):
    """Trying again later can help (a timeout, HTTP 503, an API server restarting)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Rewind(TransientError):
    """Read again from ``offsets`` (per partition) after ``retry_after_s``: results of
    records from there on were lost before they were durable. Raised by
    :meth:`Handler.handle_batch` or :meth:`Handler.tick`; the records of the batch at
    hand are read again too."""

    def __init__(self, message: str, offsets: dict[TP, int], *, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.offsets = dict(offsets)


class PermanentError(Exception):
    """This record can never be handled (invalid, refused for good): dead-letter it."""


class FatalError(Exception):
    """The service cannot go on (configuration, credentials, an unwritable dead-letter
    topic): it stops, commits nothing more and exits non-zero. The message says what to
    fix; uncommitted records are handled again after the restart."""


class DeadLetterError(FatalError):
    """A dead letter was not delivered; no offset past its message was committed."""


class BrokerUnreachable(FatalError):
    """The broker stayed unreachable longer than ``broker_timeout_s``."""


class CredentialsRefused(FatalError):
    """The broker refused the service's SASL credentials or TLS client certificate:
    retrying cannot help, so the service stops at once (no ``broker_timeout_s`` wait)."""
