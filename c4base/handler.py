"""A service's part of the consumer loop: :class:`Handler` and its defaults.

The loop (:class:`~c4base.runtime.ConsumerRunner`) offers a :class:`Context`; the
handler raises the classified failures of :mod:`c4base.failures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from c4base.failures import TP
from c4base.progress import Hold, Record

__all__ = ["BaseHandler", "BatchFailed", "Context", "Handler"]


class Context(Protocol):
    """What the runner offers a handler while it handles records."""

    def hold(self, rec: Record) -> Hold:
        """The result of ``rec`` becomes durable later: do not commit past it until the
        hold is released."""
        ...

    def dead_letter(self, rec: Record, reason: str) -> None:
        """Send ``rec`` to the dead-letter topic (confirmed before any commit past it)."""
        ...


class Handler(Protocol):
    """A service's part of the loop. Only :meth:`handle` is required; see
    :class:`BaseHandler` for the defaults."""

    def handle(self, rec: Record, ctx: Context) -> None:
        """Handle one record; raise a classified error (module docstring) on failure."""
        ...

    def handle_batch(self, records: Sequence[Record], ctx: Context) -> None:
        """Handle records in order; raise :class:`BatchFailed` to say which one failed."""
        ...

    def pending(self) -> dict[TP, int]:
        """Per partition, the lowest offset whose result is not durable yet."""
        ...

    def tick(self, ctx: Context) -> None:
        """About every ``tick_s``: time-driven work (file rolls, resolve timers)."""
        ...

    def revoked(self, tps: list[TP], lost: bool) -> None:
        """Partitions go away: make what can be durable durable (then a commit follows
        unless ``lost``)."""
        ...

    def close(self, stop_by: float, ctx: Context) -> None:
        """Clean stop: finish what can be finished before monotonic time ``stop_by``."""
        ...

    def abort(self) -> None:
        """After a fatal error: drop what is not durable (it is consumed again)."""
        ...

    def status(self) -> dict[str, Any]: ...


class BaseHandler:
    """Defaults for the optional parts of :class:`Handler`."""

    def handle(self, rec: Record, ctx: Context) -> None:
        raise NotImplementedError

    def handle_batch(self, records: Sequence[Record], ctx: Context) -> None:
        """Records one by one; a failure says which record it was."""
        for i, rec in enumerate(records):
            try:
                self.handle(rec, ctx)
            except Exception as err:
                raise BatchFailed(i, err) from err

    def pending(self) -> dict[TP, int]:
        return {}

    def tick(self, ctx: Context) -> None:
        pass

    def revoked(self, tps: list[TP], lost: bool) -> None:
        pass

    def close(self, stop_by: float, ctx: Context) -> None:
        pass

    def abort(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}


class BatchFailed(Exception):
    """Raised by :meth:`Handler.handle_batch`: the records before ``index`` are handled,
    the one at ``index`` failed with ``error`` (classified like any other)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error
