"""An alerter killed after a chat accepted a post and before the message's offset was
committed (the ~0.25 s window of one poll) read the message again at its restart and
posted the alert a second time. The sent ledger (sinks/alert/sent.py) records each post
before and after it: the restarted alerter posts nothing twice. Real loopback webhook
receivers (tests/sinks/test_alert_slow_receiver.py's); no Kafka (the handler is the
alerter's Kafka side without the consumer loop; a kill is its abort without a commit)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from c4base.progress import Record
from c4base.topics import Topics
from sinks.alert.config import AlertConfig, Destination
from sinks.alert.consumer import AlertHandler
from sinks.alert.samples import sample_command
from streams.commands import encode_command
from tests.sinks.test_alert_slow_receiver import Receiver

pytestmark = pytest.mark.timeout(60)

TOPICS = Topics(prefix="restart.")


class _Hold:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


class _Ctx:
    """What the consumer loop gives a handler: holds (released = committable)."""

    def __init__(self) -> None:
        self.holds: list[_Hold] = []
        self.letters: list[str] = []

    def hold(self, rec: Record) -> _Hold:
        self.holds.append(_Hold())
        return self.holds[-1]

    def dead_letter(self, rec: Record, reason: str) -> None:
        self.letters.append(reason)


def _record(i: int, host: str) -> Record:
    cmd = encode_command(sample_command(host, id=f"c{i}"))
    return Record(TOPICS.isolations, 0, i, host.encode(), cmd, 1_764_000_000_000 + i)


def _wait(pred, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _config(url: str, ledger: Path, timeout_s: float = 10.0) -> AlertConfig:
    return AlertConfig(destination=[Destination(type="slack", url=url, name="chat",
                                                min_severity="info")],
                       sent_ledger=str(ledger), timeout_s=timeout_s)  # fmt: skip


def test_a_message_read_again_after_a_kill_is_not_posted_twice(tmp_path: Path) -> None:
    ledger = tmp_path / "sent.sqlite3"
    recs = [_record(i, f"h{i}") for i in range(3)]
    with Receiver(0.0) as chat:
        first, ctx = AlertHandler(_config(chat.url, ledger), TOPICS), _Ctx()
        for r in recs:
            first.handle(r, ctx)
        _wait(lambda: len(ctx.holds) == 3 and all(h.released for h in ctx.holds))
        first.abort()  # killed: nothing was committed, the messages are read again
        again, ctx2 = AlertHandler(_config(chat.url, ledger), TOPICS), _Ctx()
        for r in [*recs, _record(3, "h3")]:  # and one message new since
            again.handle(r, ctx2)
        _wait(lambda: len(chat.posts) >= 4)
        time.sleep(0.5)  # nothing more arrives
        posts = len(chat.posts)
        again.abort()
    assert posts == 4 and again.stats.repeats == 3
    assert ctx2.letters == [] and all(h.released for h in ctx2.holds)


def test_a_kill_while_a_post_was_out_does_not_post_it_again(tmp_path: Path) -> None:
    """Killed after the receiver took the request, before its answer: it may have posted
    it, and a chat would show a repeat twice, so the restart settles it as maybe
    delivered (the read-timeout rule)."""
    ledger = tmp_path / "sent.sqlite3"
    with Receiver(3.0) as chat:
        first = AlertHandler(_config(chat.url, ledger), TOPICS)
        first.handle(_record(0, "h0"), _Ctx())
        _wait(lambda: len(chat.posts) == 1)
        first.abort()  # while the receiver still holds its answer
        again, ctx = AlertHandler(_config(chat.url, ledger), TOPICS), _Ctx()
        again.handle(_record(0, "h0"), ctx)
        time.sleep(1.0)
        posts = len(chat.posts)
        again.abort()
    assert posts == 1 and again.stats.repeats == 1
