"""Delivery: a bounded queue per destination, requests in parallel, retries with back-off.

Why per destination: a slow or failing chat (Teams throttling, a DingTalk outage) must not
delay the others. Within a destination up to ``max_in_flight`` requests run at once, one
per alert (``job/host``) at a time: a host's messages stay in order (a ``resolved``
never overtakes its ``firing``), while a receiver that takes T seconds to answer delays
the n-th alert of a burst by about ``ceil(n / max_in_flight) * T`` instead of ``n * T``
(issue 25: 40 alerts to a receiver answering after 10 s, one at a time, ended 412 s late).

Unconfirmed requests: a read timeout after the request was sent means the receiver may
have posted the message. Where the target deduplicates
(``Target.idempotent``: Alertmanager's API, an alert is its label set) it is retried
like any failure. A chat webhook has no deduplication key (Slack, Teams, Discord,
Mattermost, DingTalk and Feishu incoming webhooks offer none), so the request is *not*
re-posted: it is logged as "maybe delivered", counted in ``DeliveryStats.unconfirmed``
and completed, unless the destination sets ``retry_unconfirmed = true``. Connection
errors and timeouts before the request was sent, 429 and 5xx answers are retried as
before: the receiver said, or could only have, not taken it. Every request carries an
``Idempotency-Key`` header (the same for every attempt of one notification), which a
receiver of its own may use to deduplicate.

Never blocking: :meth:`Delivery.offer` is a plain function that appends to a bounded
deque and returns at once, so the Kafka consumer loop never waits on HTTP. When a
destination's queue is full the *oldest notification of the lowest severity present*
(counting the newcomer) is dropped and counted in :class:`DeliveryStats` — a burst of
``info`` verdicts cannot push out a ``critical`` cordon.

Retries: on connection errors and timeouts, on HTTP 429 and 5xx, and on the
rate-limit codes DingTalk and Feishu return inside HTTP 200, for as long as the
notification is younger than ``retry_for_s`` (default 10 minutes, counted from when it
was queued, so a long outage does not make each queued notification wait its own
window) and, when set, at most ``max_attempts`` tries.
The wait is the server's ``Retry-After`` when it sent one (seconds or an HTTP date,
capped by ``retry_after_max_s``), else "full jitter" exponential back-off,
``uniform(0, min(backoff_max_s, backoff_base_s * 2**(attempt-1)))`` (the AWS
architecture blog's "Exponential Backoff and Jitter", which spreads retries of many
clients best). Other 4xx and vendor error codes are not retried: they will not heal.

Every queued notification ends in exactly one call of its ``done(ok, detail)``
callback: delivered, given up, or dropped from a full queue. The Kafka side
(:mod:`sinks.alert.consumer`) commits a message only after the callbacks of all its
notifications, and dead-letters the ones that were not delivered: nothing is dropped
silently.

Logs name the destination and its redacted URL (scheme and host) only; httpx's own
request log lines, which print full URLs with tokens and signatures, are raised to
WARNING by :func:`quiet_http_loggers`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import msgspec

from sinks.alert.model import SEVERITIES, Notification, severity_rank
from sinks.alert.sent import SentLedger
from sinks.alert.targets import Outcome, Target

__all__ = [
    "Delivery",
    "DeliveryStats",
    "Done",
    "backoff_delay",
    "idempotency_key",
    "parse_retry_after",
    "quiet_http_loggers",
]

log = logging.getLogger(__name__)

USER_AGENT = "c4stream-alert/0.1"
DROP_LOG_INTERVAL_S = 10.0

Done = Callable[[bool, str], None]
"""Called once per queued notification: (delivered?, what happened)."""


def _ignore(ok: bool, detail: str) -> None:
    pass


@dataclass(slots=True)
class _Item:
    """A queued notification with its completion callback and when it was queued."""

    n: Notification
    done: Done
    queued: float
    ident: str = ""
    """Its delivery id in the sent ledger ("": not recorded; :mod:`sinks.alert.sent`)."""

    @property
    def severity(self) -> str:
        return self.n.severity

    @property
    def key(self) -> str:
        return self.n.key


#: The request was sent whole and the receiver kept the connection open without an
#: answer: it may have posted the message. (A reset or close while reading is not
#: here: it is also what a keep-alive connection the server had already closed looks
#: like, where nothing was received, so it is retried.)
_UNCONFIRMED = (httpx.ReadTimeout,)


def _on_sent(mark: Callable[[str], object]) -> Callable[[str, dict], Awaitable[None]]:
    """httpcore's trace hook: ``sent`` once the request's body is written. A kill
    before it leaves the receiver an incomplete request at most (discarded: the restart
    posts it again); after it, the receiver has it (the restart says "maybe
    delivered"). Between the write and the mark (microseconds) a kill posts twice: at
    least once, as alerts are. (Marked between headers and body, a kill there lost the
    alert: 1 of 40 with the kill timed by the posts' arrival.)"""

    async def trace(event: str, info: dict) -> None:
        if event.endswith("send_request_body.complete"):
            mark("sent")

    return trace


def idempotency_key(n: Notification) -> str:
    """One key per notification, the same on every attempt: a hash of its content.
    (Not across an alerter restart: the notification's ``starts_at`` is the alerter's
    clock when the alert opened, so one re-read after a restart is a new notification.)

    >>> from sinks.alert.samples import sample_notification
    >>> n = sample_notification()
    >>> idempotency_key(n) == idempotency_key(n), len(idempotency_key(n))
    (True, 32)
    """
    body = msgspec.json.encode(dataclasses.asdict(n))
    return hashlib.sha256(body).hexdigest()[:32]


def quiet_http_loggers() -> None:
    """httpx logs every request URL at INFO; webhook URLs are credentials, so keep it quiet."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP-date), or None.

    >>> parse_retry_after("1"), parse_retry_after("0.5"), parse_retry_after(None)
    (1.0, 0.5, None)
    >>> parse_retry_after("Thu, 01 Jan 1970 00:00:10 GMT", now=4.0)
    6.0
    >>> parse_retry_after("soon") is None
    True
    """
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def backoff_delay(
    attempt: int, base_s: float, max_s: float, rng: Callable[[], float] = random.random
) -> float:
    """Full-jitter back-off before retry number ``attempt`` (1 = first retry).

    >>> backoff_delay(1, 1.0, 60.0, rng=lambda: 1.0), backoff_delay(10, 1.0, 60.0, lambda: 1.0)
    (1.0, 60.0)
    """
    return rng() * min(max_s, base_s * 2 ** (attempt - 1))


@dataclass
class DeliveryStats:
    enqueued: int = 0
    delivered: int = 0
    failed: int = 0
    """Given up: permanent error, or retries exhausted."""
    retries: int = 0
    unconfirmed: int = 0
    """Sent, no answer (read timeout), not re-posted: maybe delivered (module doc)."""
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEVERITIES, 0))
    """Dropped from a full queue, by severity."""

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


class _BoundedQueue:
    """FIFO of notifications for one destination; full -> drop oldest of lowest severity.

    One deque per severity, entries tagged with an arrival number: the worker takes the
    oldest head of the three (FIFO overall), a drop takes the head of the lowest
    non-empty one. Both are O(1), so a flood costs the consumer no more than a trickle.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        # Entries are notifications or anything with their ``severity`` (_Item).
        self._by_severity: list[deque[tuple[int, Any]]] = [deque() for _ in SEVERITIES]
        self._seq = 0
        self._len = 0
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return self._len

    def snapshot(self) -> list[Any]:
        """Queued entries in the order they will be sent."""
        entries = sorted((e for q in self._by_severity for e in q), key=lambda e: e[0])
        return [n for _, n in entries]

    def put_nowait(self, n: Any) -> Any | None:
        """Append ``n``; returns the notification dropped to make room, if any."""
        rank = severity_rank(n.severity)
        dropped: Notification | None = None
        if self._len >= self.maxsize:
            lowest = next(i for i, q in enumerate(self._by_severity) if q)
            if rank < lowest:
                return n  # the newcomer is the least important of all
            _, dropped = self._by_severity[lowest].popleft()
            self._len -= 1
        self._by_severity[rank].append((self._seq, n))
        self._seq += 1
        self._len += 1
        self._ready.set()
        return dropped

    async def get(self, busy: set[str] | frozenset[str] = frozenset()) -> Any:
        """The oldest entry whose ``key`` is not in ``busy`` (an alert with a request in
        flight waits for it: its messages stay in order); waits for one."""
        while True:
            best: tuple[int, int, int] | None = None  # (arrival, severity queue, index)
            for qi, q in enumerate(self._by_severity):
                for i, (seq, n) in enumerate(q):
                    if n.key not in busy:
                        if best is None or seq < best[0]:
                            best = (seq, qi, i)
                        break  # later entries of this queue are younger
            if best is not None:
                _, qi, i = best
                q = self._by_severity[qi]
                entry = q.popleft() if i == 0 else q[i]
                if i:
                    del q[i]
                self._len -= 1
                return entry[1]
            self._ready.clear()
            await self._ready.wait()

    def poke(self) -> None:
        """An alert's request finished: its next entry may be taken now."""
        self._ready.set()


class Delivery:
    """Sends notifications to targets in the background. Use inside a running event loop.

    ``async with Delivery(targets, ...) as d: d.offer("ops", n); await d.drain(5)``
    """

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        queue_size: int = 1000,
        max_attempts: int = 0,
        retry_for_s: float = 600.0,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        retry_after_max_s: float = 300.0,
        timeout_s: float = 10.0,
        client: httpx.AsyncClient | None = None,
        rng: Callable[[], float] = random.random,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.targets = {t.name: t for t in targets}
        self.max_attempts = max_attempts
        self.retry_for_s = retry_for_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.retry_after_max_s = retry_after_max_s
        self.stats = DeliveryStats()
        self._queues = {name: _BoundedQueue(queue_size) for name in self.targets}
        self._busy = dict.fromkeys(self.targets, 0)
        """Per destination: notifications taken from the queue and not finished."""
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=timeout_s, follow_redirects=False, headers={"User-Agent": USER_AGENT}
        )
        self._rng = rng
        self._sleep = sleep
        self._workers: list[asyncio.Task[None]] = []
        self._last_drop_log: dict[str, float] = {}
        self.sent: SentLedger | None = None
        """Where each recorded delivery's post is written before and after it."""
        quiet_http_loggers()

    async def __aenter__(self) -> Delivery:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._work(name), name=f"alert-delivery-{name}")
                for name in self.targets
            ]

    def offer(
        self, destination: str, n: Notification, done: Done = _ignore, ident: str = ""
    ) -> bool:
        """Queue ``n`` for ``destination`` without waiting; False if ``n`` itself was
        dropped. ``done`` is called once ``n`` is delivered, given up or dropped;
        ``ident``: its delivery id, recorded in :attr:`sent` around the post."""
        item = _Item(n, done, time.monotonic(), ident)
        dropped = self._queues[destination].put_nowait(item)
        self.stats.enqueued += 1
        if dropped is not None:
            self.stats.dropped[dropped.severity] += 1
            dropped.done(
                False, f"queue of {destination} full ({self._queues[destination].maxsize})"
            )
            # One line per destination per interval: a flood must not flood the log too.
            now = time.monotonic()
            if now - self._last_drop_log.get(destination, -1e9) >= DROP_LOG_INTERVAL_S:
                self._last_drop_log[destination] = now
                log.warning(
                    "alert queue of %s full (%d): dropping the oldest lowest-severity "
                    "notifications, %d dropped so far %s",
                    destination,
                    self._queues[destination].maxsize,
                    self.stats.dropped_total,
                    self.stats.dropped,
                )
        return dropped is not item

    def pending(self) -> int:
        """Notifications queued or being sent."""
        return sum(len(q) for q in self._queues.values()) + sum(self._busy.values())

    async def drain(self, timeout_s: float) -> bool:
        """Wait until everything queued was sent or given up; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.pending():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def aclose(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        if self._own_client:
            await self._client.aclose()

    async def _work(self, name: str) -> None:
        """Take notifications in queue order; at most ``max_in_flight`` at once, and a
        notification waits for the one before it of the same alert (order per host)."""
        queue = self._queues[name]
        slots = asyncio.Semaphore(self.targets[name].destination.max_in_flight)
        busy: set[str] = set()
        """Alerts with a request in flight; their next messages wait in the queue (where
        the full-queue rule still applies to them)."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                await slots.acquire()
                try:
                    item: _Item = await queue.get(busy)
                except BaseException:
                    slots.release()
                    raise
                self._busy[name] += 1
                busy.add(item.key)
                task = asyncio.create_task(self._send_item(name, item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

                def finished(_t: asyncio.Task[None], key: str = item.key) -> None:
                    busy.discard(key)
                    slots.release()
                    queue.poke()

                task.add_done_callback(finished)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send_item(self, name: str, item: _Item) -> None:
        ok, detail = False, "not sent"
        try:
            ok, detail = await self.attempt(
                self.targets[name], item.n, deadline=item.queued + self.retry_for_s,
                ident=item.ident,
            )  # fmt: skip
        except asyncio.CancelledError:
            detail = "alerter stopped before it was sent"
            raise
        except Exception as err:  # a bug in one target must not kill its worker
            self.stats.failed += 1
            detail = f"unexpected {type(err).__name__}: {err}"
            log.exception("alert to %s failed unexpectedly", name)
        finally:
            self._busy[name] -= 1
            item.done(ok, detail)

    async def send(self, target: Target, n: Notification, *, within_s: float | None = None) -> bool:
        """POST ``n`` to ``target`` with retries for ``within_s`` (default
        ``retry_for_s``); True once delivered."""
        window = self.retry_for_s if within_s is None else within_s
        ok, _ = await self.attempt(target, n, deadline=time.monotonic() + window)
        return ok

    async def attempt(
        self, target: Target, n: Notification, *, deadline: float, ident: str = ""
    ) -> tuple[bool, str]:
        """POST ``n`` with retries until delivered, refused for good, ``max_attempts``
        (when set) or monotonic time ``deadline``; (delivered?, what happened).
        ``ident``: its delivery id; each request is then recorded in :attr:`sent`
        before it goes out and once its answer says what became of it."""
        where = f"{target.name} ({target.destination.redacted_url})"
        key = idempotency_key(n)
        attempt = 0
        sent = self.sent if ident else None
        mark = (lambda st: sent.mark(ident, st)) if sent is not None else (lambda st: None)
        while True:
            attempt += 1
            req = target.request(n)  # re-signed on every attempt
            retry_after: float | None = None
            # durable before the request: a kill during it is known (and whether the
            # receiver had refused it before: an outage, where a re-post loses nothing)
            mark("posting" if attempt == 1 else "reposting")
            try:
                resp = await self._client.post(
                    req.url,
                    content=req.body(),
                    headers={
                        "Content-Type": "application/json",
                        "Idempotency-Key": key,
                        **req.headers,
                    },
                    extensions={"trace": _on_sent(mark) if attempt == 1 else None},
                )
            except _UNCONFIRMED as err:
                if not (target.idempotent or target.destination.retry_unconfirmed):
                    self.stats.unconfirmed += 1
                    log.warning(
                        "alert %s %s to %s: %s after the request was sent: maybe delivered; "
                        "not re-posted (a chat would show it twice; retry_unconfirmed = "
                        "true re-posts)",
                        n.status,
                        n.key,
                        where,
                        type(err).__name__,
                    )
                    mark("unconfirmed")
                    return True, f"maybe delivered to {target.name}: {type(err).__name__}"
                outcome, detail = Outcome.RETRY, f"{type(err).__name__} (unconfirmed)"
            except httpx.TransportError as err:
                outcome, detail = Outcome.RETRY, f"{type(err).__name__}"
            else:
                outcome, detail = target.judge(resp.status_code, resp.content)
                if outcome is Outcome.RETRY:
                    retry_after = parse_retry_after(resp.headers.get("retry-after"))
            # not taken (refused, or nothing sent) is safe to post again; a timeout after
            # the request was sent, retried here, stays "posting" (a repeat is harmless)
            if not (outcome is Outcome.RETRY and detail.endswith("(unconfirmed)")):
                mark("posted" if outcome is Outcome.OK else "failed")
            if outcome is Outcome.OK:
                self.stats.delivered += 1
                log.debug("alert %s %s sent to %s", n.status, n.key, where)
                return True, "delivered"
            now = time.monotonic()
            if outcome is Outcome.FAIL or attempt == self.max_attempts or now >= deadline:
                self.stats.failed += 1
                log.error(
                    "alert %s %s to %s not delivered after %d attempt(s): %s",
                    n.status,
                    n.key,
                    where,
                    attempt,
                    detail,
                )
                return False, f"not delivered to {target.name} after {attempt} attempt(s): {detail}"
            if retry_after is not None:
                delay = min(retry_after, self.retry_after_max_s)
            else:
                delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_max_s, self._rng)
            self.stats.retries += 1
            log.info("alert to %s: %s; retry %d in %.2fs", where, detail, attempt, delay)
            await self._sleep(delay)
