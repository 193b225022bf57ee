"""Grouping, de-duplication, resolve and severity routing; then the same end to end over HTTP."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from sinks.alert.alerter import Alerter
from sinks.alert.config import AlertConfig, Destination
from sinks.alert.grouping import Grouper, Observation
from sinks.alert.routing import Router
from sinks.alert.samples import sample_command
from streams.commands import IsolationCommand
from streams.verdicts import Verdict
from tests.sinks.test_alert_support import (
    WebhookServer,
    webhook_server_fixture,  # noqa: F401 (the fixture)
)


def _command(
    i: int, host: str = "h3", action: str = "cordon", fault: str = "straggler"
) -> IsolationCommand:
    return msgspec.structs.replace(
        sample_command(host), id=f"{host}-c{i}", action=action, fault=fault, reason=f"reason {i}"
    )


def _cmd(i: int, host: str = "h3", action: str = "cordon", fault: str = "straggler") -> Observation:
    return Observation.of_command(_command(i, host, action, fault))


def _verdict(i: int, host: str = "h3", score: float = 0.9) -> Verdict:
    return Verdict(
        id=f"{host}-v{i}",
        ts_us=i,
        job="llm-pretrain-7b",
        comm="0xa",
        host=host,
        fault="slow_nic",
        score=score,
        reason=f"verdict {i}",
        window_start_us=0,
        window_end_us=i,
    )


def test_three_commands_for_one_host_make_one_alert() -> None:
    g = Grouper(resolve_timeout_s=60)
    out = [n for i in range(3) for n in g.observe(_cmd(i), now=100.0 + i)]
    assert [n.status for n in out] == ["firing"]
    assert len(g) == 1 and g.stats.folded == 2
    assert out[0].summary == "reason 0" and out[0].commands == 1


def test_redelivered_command_is_a_duplicate() -> None:
    g = Grouper(resolve_timeout_s=60)
    assert len(g.observe(_cmd(0), 1.0)) == 1
    assert g.observe(_cmd(0), 2.0) == []
    assert g.stats.duplicates == 1
    (resolved,) = g.expire(100.0)
    assert resolved.commands == 1  # the duplicate was not counted


def test_resolve_after_quiet_period_then_reopen() -> None:
    g = Grouper(resolve_timeout_s=60)
    g.observe(_cmd(0), 100.0)
    g.observe(_cmd(1), 130.0)
    assert g.expire(189.9) == []  # 59.9 s after the last one: still open
    (n,) = g.expire(190.0)
    assert n.status == "resolved" and n.ends_at == 190.0 and n.starts_at == 100.0
    assert n.commands == 2 and n.summary == "reason 1"
    assert "resolved" in n.text and "resolve timeout" in n.text
    assert len(g) == 0
    (again,) = g.observe(_cmd(2), 500.0)
    assert again.status == "firing" and again.commands == 1


def test_late_arrival_resolves_the_old_alert_before_opening_a_new_one() -> None:
    g = Grouper(resolve_timeout_s=60)
    g.observe(_cmd(0), 0.0)
    out = g.observe(_cmd(1), 1000.0)  # no tick in between
    assert [n.status for n in out] == ["resolved", "firing"]
    assert out[0].ends_at == 60.0


def test_escalation_from_verdict_to_command_notifies_once_more() -> None:
    g = Grouper(resolve_timeout_s=60)
    (first,) = g.observe(Observation.of_verdict(_verdict(0)), 1.0)
    assert first.severity == "warning" and first.verdicts == 1
    (esc,) = g.observe(_cmd(0, action="cordon_and_taint"), 2.0)
    assert esc.status == "firing" and esc.escalated and esc.severity == "critical"
    assert esc.faults == ("slow_nic", "straggler") and esc.action == "cordon_and_taint"
    assert "Escalated to critical" in esc.text
    # A later, lower-severity verdict neither notifies nor replaces the command's reason.
    assert g.observe(Observation.of_verdict(_verdict(1, score=0.3)), 3.0) == []
    (res,) = g.expire(100.0)
    assert res.summary == "reason 0" and res.verdicts == 2 and res.commands == 1


def test_hosts_are_separate_alerts_and_state_is_bounded() -> None:
    g = Grouper(resolve_timeout_s=60, max_groups=3)
    out = [n for i in range(5) for n in g.observe(_cmd(0, host=f"h{i}"), float(i))]
    assert [n.host for n in out] == ["h0", "h1", "h2", "h3", "h4"]
    assert len(g) == 3 and g.stats.evicted == 2


def test_reminder_after_repeat_interval() -> None:
    g = Grouper(resolve_timeout_s=600, repeat_interval_s=100)
    g.observe(_cmd(0), 0.0)
    assert g.observe(_cmd(1), 50.0) == []
    (again,) = g.observe(_cmd(2), 150.0)
    assert again.status == "firing" and not again.escalated and again.commands == 3


def test_routing_by_severity() -> None:
    dests = [
        Destination(type="slack", url="http://x", name="all", min_severity="info"),
        Destination(type="teams", url="http://x", name="warn", min_severity="warning"),
        Destination(
            type="dingtalk",
            url="http://x",
            name="crit",
            min_severity="critical",
            send_resolved=False,
        ),
    ]
    r = Router(dests)
    assert r.route_severity("info", "firing") == ["all"]
    assert r.route_severity("warning", "firing") == ["all", "warn"]
    assert r.route_severity("critical", "firing") == ["all", "warn", "crit"]
    assert r.route_severity("critical", "resolved") == ["all", "warn"]


@pytest.mark.timeout(30)
def test_end_to_end_grouping_routing_and_resolve_over_http(webhook_server: WebhookServer) -> None:
    """3 cordon commands for h3 and a warning verdict for h5 reach each chat as grouped,
    severity-routed alerts; after the quiet period each chat that was told gets "resolved"."""
    now = [1000.0]
    cfg = AlertConfig(
        destination=[
            Destination(
                type="slack", url=webhook_server.url("/all"), name="all", min_severity="info"
            ),
            Destination(
                type="alertmanager",
                url=webhook_server.url("/crit"),
                name="crit",
                min_severity="critical",
            ),
        ],
        resolve_timeout_s=60,
    )

    async def go() -> None:
        async with Alerter.from_config(cfg, clock=lambda: now[0]) as a:
            for i in range(3):
                a.on_command(_command(i, host="h3"))
                now[0] += 1
            a.on_verdict(_verdict(0, host="h5", score=0.85))
            assert await a.delivery.drain(10)
            now[0] += 61
            a.tick()
            assert await a.delivery.drain(10)

    asyncio.run(go())
    slack = [r.json["text"] for r in webhook_server.at("/all")]
    am = [r.json for r in webhook_server.at("/crit")]
    # One host's messages arrive in order; hosts are delivered in parallel (max_in_flight),
    # so h3's and h5's firing (and resolved) messages may arrive either way round.
    titles = [t.split(" (job")[0] for t in slack]
    assert sorted(titles[:2]) == [
        "[FIRING:critical] straggler on h3",  # once for three commands
        "[FIRING:warning] slow_nic on h5",  # a warning verdict: only the info destination
    ]
    assert sorted(titles[2:]) == [
        "[RESOLVED:critical] straggler on h3",
        "[RESOLVED:warning] slow_nic on h5",
    ]
    resolved_h3 = webhook_server.at("/all")[
        2 + titles[2:].index("[RESOLVED:critical] straggler on h3")
    ].json
    facts = [f["text"] for b in resolved_h3["blocks"] if "fields" in b for f in b["fields"]]
    assert "*Commands / verdicts*\n3 / 0" in facts
    assert [(j["status"], j["commonLabels"]["host"]) for j in am] == [
        ("firing", "h3"),
        ("resolved", "h3"),
    ]
    assert am[0]["alerts"][0]["endsAt"] == "0001-01-01T00:00:00Z"
    assert am[1]["alerts"][0]["endsAt"] == "1970-01-01T00:17:42Z"  # last arrival 1002 s + 60 s
    assert am[0]["alerts"][0]["fingerprint"] == am[1]["alerts"][0]["fingerprint"]


def test_actuator_outcomes_join_the_hosts_alert_in_either_order() -> None:
    """Issue 13, defect 6: alerts said "cordon" even when the actuator failed."""
    g = Grouper(resolve_timeout_s=60)
    (first,) = g.observe(_cmd(0), 1.0)
    assert first.outcome is None
    (upd,) = g.observe_outcome("llm-pretrain-7b", "h3", "failed", "Invalid user id", False, 2.0)
    assert upd.status == "firing" and upd.outcome == "failed"
    assert "Actuator: failed (Invalid user id)" in upd.text
    assert ("Actuator", "failed: Invalid user id") in upd.facts()
    # acted / dry run only update the alert; the same outcome twice says nothing new
    assert g.observe_outcome("llm-pretrain-7b", "h3", "failed", "Invalid user id", False, 3.0) == []
    assert g.observe_outcome("llm-pretrain-7b", "h3", "acted", "drained", False, 4.0) == []
    # an outcome read before its command is applied when the alert opens
    assert g.observe_outcome("llm-pretrain-7b", "h4", "dry_run", "would drain", True, 5.0) == []
    (h4,) = g.observe(_cmd(0, host="h4"), 5.5)
    assert h4.outcome == "dry_run" and h4.dry_run is True


def test_a_dry_run_command_is_a_warning() -> None:
    g = Grouper(resolve_timeout_s=60)
    cmd = msgspec.structs.replace(_command(0), dry_run=True)
    (n,) = g.observe(Observation.of_command(cmd), 1.0)
    assert n.severity == "warning" and ("Action", "cordon (dry run)") in n.facts()
