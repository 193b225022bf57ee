"""Every chat target: one contract test over all of them, then exact payloads and signatures.

The format validators below are written from each vendor's published webhook format
(limits included), independently of the renderers; the signatures are recomputed here
from the vendors' formulas, not with the code under test.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
from datetime import datetime
from typing import Any
from urllib.parse import quote_plus

import jsonschema
import pytest

from sinks.alert.config import AlertConfig, Destination
from sinks.alert.delivery import Delivery
from sinks.alert.model import Notification
from sinks.alert.samples import sample_notification
from sinks.alert.targets import TARGETS, make_target
from tests.sinks.test_alert_support import (
    Reply,
    WebhookServer,
    webhook_server_fixture,  # noqa: F401 (the fixture)
)

NOW = 1_764_000_000.0  # fixed signing clock: 2025-11-24T16:00:00Z
EXTERNAL = "https://grafana.example.org/d/c4"

_TEXT_OBJ = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["plain_text", "mrkdwn"]}, "text": {"type": "string"}},
}
_ISO = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$"

VALIDATORS: dict[str, dict[str, Any]] = {
    # Slack incoming webhook with Block Kit: header text plain_text <= 150; section text
    # <= 3000, fields <= 10 of <= 2000; context <= 10 elements; <= 50 blocks.
    "slack": {
        "type": "object",
        "required": ["text", "blocks"],
        "properties": {
            "text": {"type": "string", "minLength": 1},
            "blocks": {
                "type": "array",
                "minItems": 1,
                "maxItems": 50,
                "items": {
                    "oneOf": [
                        {
                            "type": "object",
                            "required": ["type", "text"],
                            "additionalProperties": False,
                            "properties": {
                                "type": {"const": "header"},
                                "block_id": {"type": "string"},
                                "text": {
                                    "type": "object",
                                    "required": ["type", "text"],
                                    "properties": {
                                        "type": {"const": "plain_text"},
                                        "text": {"type": "string", "maxLength": 150},
                                        "emoji": {"type": "boolean"},
                                    },
                                },
                            },
                        },
                        {
                            "type": "object",
                            "required": ["type"],
                            "anyOf": [{"required": ["text"]}, {"required": ["fields"]}],
                            "additionalProperties": False,
                            "properties": {
                                "type": {"const": "section"},
                                "block_id": {"type": "string"},
                                "text": {
                                    **_TEXT_OBJ,
                                    "properties": {
                                        **_TEXT_OBJ["properties"],
                                        "text": {"type": "string", "maxLength": 3000},
                                    },
                                },
                                "fields": {
                                    "type": "array",
                                    "maxItems": 10,
                                    "items": {
                                        **_TEXT_OBJ,
                                        "properties": {
                                            **_TEXT_OBJ["properties"],
                                            "text": {"type": "string", "maxLength": 2000},
                                        },
                                    },
                                },
                            },
                        },
                        {
                            "type": "object",
                            "required": ["type", "elements"],
                            "additionalProperties": False,
                            "properties": {
                                "type": {"const": "context"},
                                "elements": {"type": "array", "maxItems": 10, "items": _TEXT_OBJ},
                            },
                        },
                    ]
                },
            },
        },
    },
    # Mattermost incoming webhook: text and/or Slack-compatible message attachments.
    "mattermost": {
        "type": "object",
        "anyOf": [{"required": ["text"]}, {"required": ["attachments"]}],
        "properties": {
            "text": {"type": "string"},
            "attachments": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        **{
                            k: {"type": "string"}
                            for k in (
                                "fallback pretext author_name author_link author_icon title "
                                "title_link text image_url thumb_url footer footer_icon"
                            ).split()
                        },
                        "color": {"type": "string", "pattern": "^#[0-9A-Fa-f]{6}$"},
                        "fields": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["title", "value"],
                                "additionalProperties": False,
                                "properties": {
                                    "short": {"type": "boolean"},
                                    "title": {"type": "string"},
                                    "value": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    # Teams Workflows webhook: a message whose attachments hold an Adaptive Card.
    "teams": {
        "type": "object",
        "required": ["type", "attachments"],
        "properties": {
            "type": {"const": "message"},
            "attachments": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["contentType", "content"],
                    "properties": {
                        "contentType": {"const": "application/vnd.microsoft.card.adaptive"},
                        "contentUrl": {"type": "null"},
                        "content": {
                            "type": "object",
                            "required": ["type", "version", "body"],
                            "properties": {
                                "type": {"const": "AdaptiveCard"},
                                "version": {"type": "string", "pattern": r"^1\.[0-6]$"},
                                "body": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {
                                        "oneOf": [
                                            {
                                                "type": "object",
                                                "required": ["type", "text"],
                                                "properties": {
                                                    "type": {"const": "TextBlock"},
                                                    "text": {"type": "string"},
                                                    "color": {
                                                        "enum": [
                                                            "Default",
                                                            "Dark",
                                                            "Light",
                                                            "Accent",
                                                            "Good",
                                                            "Warning",
                                                            "Attention",
                                                        ]
                                                    },
                                                },
                                            },
                                            {
                                                "type": "object",
                                                "required": ["type", "facts"],
                                                "properties": {
                                                    "type": {"const": "FactSet"},
                                                    "facts": {
                                                        "type": "array",
                                                        "items": {
                                                            "type": "object",
                                                            "required": ["title", "value"],
                                                            "additionalProperties": False,
                                                            "properties": {
                                                                "title": {"type": "string"},
                                                                "value": {"type": "string"},
                                                            },
                                                        },
                                                    },
                                                },
                                            },
                                        ]
                                    },
                                },
                                "actions": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["type", "url"],
                                        "properties": {"type": {"const": "Action.OpenUrl"}},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    # DingTalk robot, markdown message.
    "dingtalk": {
        "type": "object",
        "required": ["msgtype", "markdown"],
        "additionalProperties": False,
        "properties": {
            "msgtype": {"const": "markdown"},
            "markdown": {
                "type": "object",
                "required": ["title", "text"],
                "additionalProperties": False,
                "properties": {
                    "title": {"type": "string", "minLength": 1},
                    "text": {"type": "string", "minLength": 1},
                },
            },
            "at": {"type": "object"},
        },
    },
    # Feishu/Lark custom bot, interactive card; timestamp and sign travel together.
    "feishu": {
        "type": "object",
        "required": ["msg_type", "card"],
        "additionalProperties": False,
        "dependentRequired": {"sign": ["timestamp"], "timestamp": ["sign"]},
        "properties": {
            "timestamp": {"type": "string", "pattern": r"^\d{10}$"},
            "sign": {"type": "string", "pattern": r"^[A-Za-z0-9+/]{43}=$"},
            "msg_type": {"const": "interactive"},
            "card": {
                "type": "object",
                "required": ["header", "elements"],
                "properties": {
                    "header": {
                        "type": "object",
                        "required": ["title"],
                        "properties": {
                            "title": {
                                "type": "object",
                                "required": ["tag", "content"],
                                "properties": {"tag": {"const": "plain_text"}},
                            },
                            "template": {
                                "enum": [
                                    "blue",
                                    "wathet",
                                    "turquoise",
                                    "green",
                                    "yellow",
                                    "orange",
                                    "red",
                                    "carmine",
                                    "violet",
                                    "purple",
                                    "indigo",
                                    "grey",
                                ]
                            },
                        },
                    },
                    "elements": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["tag"],
                            "properties": {
                                "tag": {"enum": ["div", "hr", "note", "markdown", "action", "img"]}
                            },
                        },
                    },
                },
            },
        },
    },
    # Discord execute-webhook: embeds with Discord's documented limits.
    "discord": {
        "type": "object",
        "anyOf": [{"required": ["content"]}, {"required": ["embeds"]}],
        "properties": {
            "content": {"type": "string", "maxLength": 2000},
            "username": {"type": "string", "minLength": 1, "maxLength": 80},
            "allowed_mentions": {"type": "object", "properties": {"parse": {"type": "array"}}},
            "embeds": {
                "type": "array",
                "maxItems": 10,
                "items": {
                    "type": "object",
                    "properties": {
                        "title": {"type": "string", "maxLength": 256},
                        "description": {"type": "string", "maxLength": 4096},
                        "url": {"type": "string"},
                        "color": {"type": "integer", "minimum": 0, "maximum": 0xFFFFFF},
                        "timestamp": {"type": "string", "pattern": _ISO},
                        "footer": {
                            "type": "object",
                            "required": ["text"],
                            "properties": {"text": {"type": "string", "maxLength": 2048}},
                        },
                        "fields": {
                            "type": "array",
                            "maxItems": 25,
                            "items": {
                                "type": "object",
                                "required": ["name", "value"],
                                "additionalProperties": False,
                                "properties": {
                                    "name": {"type": "string", "minLength": 1, "maxLength": 256},
                                    "value": {"type": "string", "minLength": 1, "maxLength": 1024},
                                    "inline": {"type": "boolean"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    # Alertmanager's own API v2: POST /api/v2/alerts takes a list of postableAlert
    # (labels required; annotations, startsAt, endsAt, generatorURL optional).
    "alertmanager_api": {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["labels", "annotations", "startsAt", "endsAt", "generatorURL"],
            "additionalProperties": False,
            "properties": {
                "labels": {
                    "type": "object",
                    "required": ["alertname", "job", "host", "severity"],
                    "additionalProperties": False,
                    "properties": {
                        k: {"type": "string", "minLength": 1}
                        for k in ("alertname", "job", "host", "severity")
                    },
                },
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                "startsAt": {"type": "string", "pattern": _ISO},
                "endsAt": {"type": "string", "pattern": _ISO},
                "generatorURL": {"type": "string"},
            },
        },
    },
    # Alertmanager webhook_config payload, version 4.
    "alertmanager_webhook": {
        "type": "object",
        "required": [
            "version",
            "groupKey",
            "truncatedAlerts",
            "status",
            "receiver",
            "groupLabels",
            "commonLabels",
            "commonAnnotations",
            "externalURL",
            "alerts",
        ],
        "properties": {
            "version": {"const": "4"},
            "groupKey": {"type": "string"},
            "truncatedAlerts": {"type": "integer", "minimum": 0},
            "status": {"enum": ["firing", "resolved"]},
            "receiver": {"type": "string"},
            "groupLabels": {"type": "object", "additionalProperties": {"type": "string"}},
            "commonLabels": {"type": "object", "additionalProperties": {"type": "string"}},
            "commonAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "externalURL": {"type": "string"},
            "alerts": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": [
                        "status",
                        "labels",
                        "annotations",
                        "startsAt",
                        "endsAt",
                        "generatorURL",
                        "fingerprint",
                    ],
                    "properties": {
                        "status": {"enum": ["firing", "resolved"]},
                        "labels": {
                            "type": "object",
                            "required": ["alertname"],
                            "additionalProperties": {"type": "string"},
                        },
                        "annotations": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "startsAt": {"type": "string", "pattern": _ISO},
                        "endsAt": {"type": "string", "pattern": _ISO},
                        "generatorURL": {"type": "string"},
                        "fingerprint": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                    },
                },
            },
        },
    },
}

SECRETS = {"dingtalk": "SECa1b2c3d4e5-dingtalk-secret", "feishu": "feishu-secret-9z8y7x"}


def _destination(kind: str, server: WebhookServer | None = None) -> Destination:
    path = f"/{kind}" + ("?access_token=tok-ding-123" if kind == "dingtalk" else "")
    url = server.url(path) if server else f"https://chat.example.org{path}"
    return Destination(type=kind, url=url, name=f"{kind}-0", secret=SECRETS.get(kind))


# --------------------------------------------------------------------- contract


def test_every_target_has_a_validator() -> None:
    assert sorted(TARGETS) == sorted(VALIDATORS)


@pytest.mark.parametrize("status", ["firing", "resolved"])
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_contract_every_target_renders_a_valid_request(kind: str, status: str) -> None:
    n = sample_notification(status)  # type: ignore[arg-type]
    target = make_target(_destination(kind), external_url=EXTERNAL, clock=lambda: NOW)
    req = target.request(n)
    jsonschema.validate(req.json, VALIDATORS[kind])
    body = req.body()
    text = json.dumps(req.json, ensure_ascii=False)
    assert n.host in text and n.job in text and "straggler" in text
    if kind == "alertmanager_api":  # Alertmanager's API says "resolved" by endsAt alone
        ends = datetime.fromisoformat(req.json[0]["endsAt"]).timestamp()
        assert (ends <= NOW) == (status == "resolved")
    else:
        assert status in text.lower()
        assert ("resolved" in text.lower()) == (status == "resolved")
    assert len(body) < 20_000  # DingTalk and Feishu refuse bodies over 20 KB
    assert req.url.startswith("https://chat.example.org/")


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_contract_long_and_hostile_text_stays_within_limits(kind: str) -> None:
    """A 10 kB reason full of markup still renders into a valid, bounded request."""
    base = sample_notification()
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    n = Notification(
        **{**fields, "summary": "<@everyone> & *x* " * 600, "faults": ("slow_nic",) * 3}
    )
    req = make_target(_destination(kind), clock=lambda: NOW).request(n)
    jsonschema.validate(req.json, VALIDATORS[kind])
    if kind == "discord":
        embed = req.json["embeds"][0]
        total = len(embed["title"]) + len(embed["description"]) + len(embed["footer"]["text"])
        total += sum(len(f["name"]) + len(f["value"]) for f in embed["fields"])
        assert total <= 6000  # Discord's limit over all text of an embed
        assert req.json["allowed_mentions"] == {"parse": []}
    if kind == "slack":
        assert "<@everyone>" not in json.dumps(req.json)  # escaped as &lt;@everyone&gt;


# --------------------------------------------------------------------- exact payloads

FACTS = [
    ("Host", "gpu-node-17"),
    ("Job", "llm-pretrain-7b"),
    ("Fault", "straggler"),
    ("Severity", "critical"),
    ("Action", "cordon_and_taint"),
    ("Confidence", "0.97"),
    ("GPU", "3"),
    ("Commands / verdicts", "1 / 0"),
    ("Since", "2025-11-24T16:00:00Z"),
]
TITLE = "[FIRING:critical] straggler on gpu-node-17 (job llm-pretrain-7b)"
REASON = (
    "gpu-node-17 GPU 3 arrived last at 96% of allreduce calls in 3 communicators over 60 s; "
    "its peers wait 41 ms per step. (c4stream alert test)"
)
FP = "488a69a029d78ccc"  # sha256("llm-pretrain-7b/gpu-node-17")[:16]


def _expected(kind: str) -> dict[str, Any]:
    if kind == "slack":
        return {
            "text": f"{TITLE}: {REASON}",
            "blocks": [
                {"type": "header", "text": {"type": "plain_text", "text": TITLE}},
                {"type": "section", "text": {"type": "mrkdwn", "text": REASON}},
                {
                    "type": "section",
                    "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"} for k, v in FACTS],
                },
                {
                    "type": "context",
                    "elements": [
                        {
                            "type": "mrkdwn",
                            "text": f"c4stream · fingerprint `{FP}` · <{EXTERNAL}|details>",
                        }
                    ],
                },
            ],
        }
    if kind == "mattermost":
        return {
            "text": f"#### {TITLE}",
            "attachments": [
                {
                    "fallback": f"{TITLE}: {REASON}",
                    "color": "#D32F2F",
                    "title": TITLE,
                    "title_link": EXTERNAL,
                    "text": REASON,
                    "fields": [{"short": True, "title": k, "value": v} for k, v in FACTS],
                    "footer": f"c4stream · fingerprint {FP}",
                }
            ],
        }
    if kind == "teams":
        return {
            "type": "message",
            "attachments": [
                {
                    "contentType": "application/vnd.microsoft.card.adaptive",
                    "contentUrl": None,
                    "content": {
                        "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                        "type": "AdaptiveCard",
                        "version": "1.4",
                        "msteams": {"width": "Full"},
                        "body": [
                            {
                                "type": "TextBlock",
                                "text": TITLE,
                                "size": "Large",
                                "weight": "Bolder",
                                "color": "Attention",
                                "wrap": True,
                            },
                            {"type": "TextBlock", "text": REASON, "wrap": True},
                            {
                                "type": "FactSet",
                                "facts": [{"title": k, "value": v} for k, v in FACTS],
                            },
                        ],
                        "actions": [
                            {"type": "Action.OpenUrl", "title": "Details", "url": EXTERNAL}
                        ],
                    },
                }
            ],
        }
    if kind == "dingtalk":
        text = "\n".join(
            [f"#### {TITLE}", "", REASON, ""]
            + [f"- **{k}**: {v}" for k, v in FACTS]
            + ["", f"[Details]({EXTERNAL})", "", f"c4stream · fingerprint {FP}"]
        )
        return {"msgtype": "markdown", "markdown": {"title": TITLE, "text": text}}
    if kind == "feishu":
        return {
            "timestamp": str(int(NOW)),
            "sign": _feishu_sign(SECRETS["feishu"], str(int(NOW))),
            "msg_type": "interactive",
            "card": {
                "config": {"wide_screen_mode": True},
                "header": {"title": {"tag": "plain_text", "content": TITLE}, "template": "red"},
                "elements": [
                    {"tag": "div", "text": {"tag": "lark_md", "content": REASON}},
                    {
                        "tag": "div",
                        "fields": [
                            {
                                "is_short": True,
                                "text": {"tag": "lark_md", "content": f"**{k}**\n{v}"},
                            }
                            for k, v in FACTS
                        ],
                    },
                    {"tag": "hr"},
                    {
                        "tag": "note",
                        "elements": [
                            {
                                "tag": "plain_text",
                                "content": f"c4stream · fingerprint {FP} · {EXTERNAL}",
                            }
                        ],
                    },
                ],
            },
        }
    if kind == "discord":
        return {
            "username": "c4stream",
            "embeds": [
                {
                    "title": TITLE,
                    "description": REASON,
                    "url": EXTERNAL,
                    "color": 0xD32F2F,
                    "fields": [{"name": k, "value": v, "inline": True} for k, v in FACTS],
                    "timestamp": "2025-11-24T16:00:00Z",
                    "footer": {"text": f"c4stream · fingerprint {FP}"},
                }
            ],
            "allowed_mentions": {"parse": []},
        }
    if kind == "alertmanager_api":
        return [  # type: ignore[return-value]
            {
                "labels": {
                    "alertname": "C4FaultyHost",
                    "job": "llm-pretrain-7b",
                    "host": "gpu-node-17",
                    "severity": "critical",
                },
                "annotations": {
                    "summary": "straggler on gpu-node-17 (job llm-pretrain-7b)",
                    "description": REASON,
                    "action": "cordon_and_taint",
                    "confidence": "0.97",
                    "gpu": "3",
                    "command_id": "c4-test-1",
                },
                "startsAt": "2025-11-24T16:00:00Z",
                "endsAt": "2025-11-24T16:04:00Z",  # NOW + 4 refresh intervals of 60 s
                "generatorURL": EXTERNAL,
            }
        ]
    assert kind == "alertmanager_webhook"
    labels = {
        "alertname": "C4FaultyHost",
        "job": "llm-pretrain-7b",
        "host": "gpu-node-17",
        "severity": "critical",
        "fault": "straggler",
    }
    annotations = {
        "summary": "straggler on gpu-node-17 (job llm-pretrain-7b)",
        "description": REASON,
        "action": "cordon_and_taint",
        "confidence": "0.97",
        "gpu": "3",
        "command_id": "c4-test-1",
    }
    return {
        "version": "4",
        "groupKey": '{}:{host="gpu-node-17", job="llm-pretrain-7b"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "alertmanager_webhook-0",
        "groupLabels": {"host": "gpu-node-17", "job": "llm-pretrain-7b"},
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": EXTERNAL,
        "alerts": [
            {
                "status": "firing",
                "labels": labels,
                "annotations": annotations,
                "startsAt": "2025-11-24T16:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": EXTERNAL,
                "fingerprint": FP,
            }
        ],
    }


# The vendors' formulas, written out again here on purpose (not imported).
def _dingtalk_sign(secret: str, timestamp_ms: str) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp_ms}\n{secret}".encode(), hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


def _feishu_sign(secret: str, timestamp_s: str) -> str:
    mac = hmac.new(f"{timestamp_s}\n{secret}".encode(), b"", hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


def _send_all(server: WebhookServer, clock: Any) -> dict[str, bool]:
    targets = [
        make_target(_destination(k, server), external_url=EXTERNAL, clock=clock)
        for k in sorted(TARGETS)
    ]
    n = sample_notification()

    async def go() -> dict[str, bool]:
        async with Delivery(targets, max_attempts=1) as d:
            oks = await asyncio.gather(*(d.send(t, n) for t in targets))
        return {t.destination.type: ok for t, ok in zip(targets, oks, strict=True)}

    return asyncio.run(go())


@pytest.mark.timeout(20)
def test_exact_payload_of_every_target_over_http(webhook_server: WebhookServer) -> None:
    assert _send_all(webhook_server, lambda: NOW) == dict.fromkeys(TARGETS, True)
    for kind in sorted(TARGETS):
        path = f"/{kind}" + ("/api/v2/alerts" if kind == "alertmanager_api" else "")
        (got,) = webhook_server.at(path)
        assert got.headers["Content-Type"] == "application/json"
        assert got.json == _expected(kind), kind
    # DingTalk: signed in the query, next to the access token, sign URL-encoded.
    (ding,) = webhook_server.at("/dingtalk")
    ts_ms = str(int(NOW * 1000))
    expected_sign = _dingtalk_sign(SECRETS["dingtalk"], ts_ms)
    assert ding.query == {"access_token": "tok-ding-123", "timestamp": ts_ms, "sign": expected_sign}
    assert ding.raw_query.endswith(f"&timestamp={ts_ms}&sign={quote_plus(expected_sign)}")
    # Unsigned targets carry nothing extra.
    assert webhook_server.at("/slack")[0].raw_query == ""


@pytest.mark.timeout(20)
def test_signatures_use_the_real_clock_in_the_right_units(webhook_server: WebhookServer) -> None:
    before = time.time()
    assert all(_send_all(webhook_server, time.time).values())
    after = time.time()
    (ding,) = webhook_server.at("/dingtalk")
    ts_ms = ding.query["timestamp"]
    assert before * 1000 - 1 <= int(ts_ms) <= after * 1000 + 1  # milliseconds
    assert ding.query["sign"] == _dingtalk_sign(SECRETS["dingtalk"], ts_ms)
    feishu = webhook_server.at("/feishu")[0].json
    assert int(before) <= int(feishu["timestamp"]) <= int(after) + 1  # seconds
    assert feishu["sign"] == _feishu_sign(SECRETS["feishu"], feishu["timestamp"])


def test_dingtalk_sign_matches_a_published_vector() -> None:
    """Known answer from an independent DingTalk SDK's test suite (docs.rs, crate dingding)."""
    from sinks.alert.targets.dingtalk import sign_dingtalk

    assert (
        sign_dingtalk("secret", 1700000000000)
        == "OuzzJR5%2BxZ4%2FEYwqtNt6sMYZQMTa%2FHEGvc9miJe7XzY%3D"
    )
    assert quote_plus(_dingtalk_sign("secret", "1700000000000")) == sign_dingtalk(
        "secret", 1700000000000
    )


@pytest.mark.timeout(30)
def test_secrets_never_logged(
    webhook_server: WebhookServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Signed sends that retry and then fail log nothing of the secrets or the webhook tokens."""
    caplog.set_level(logging.DEBUG)
    for kind in ("dingtalk", "feishu"):
        webhook_server.script(
            f"/{kind}",
            Reply(503, b"busy"),
            Reply(429, b"slow down", {"Retry-After": "0"}),
            Reply(400, b'{"errcode": 310000, "errmsg": "sign not match"}'),
        )
    cfg = AlertConfig(
        destination=[
            _destination("dingtalk", webhook_server),
            _destination("feishu", webhook_server),
        ],
        backoff_base_s=0.01,
    )
    targets = [make_target(d) for d in cfg.destination]

    async def go() -> list[bool]:
        async with Delivery(targets, backoff_base_s=0.01) as d:
            return list(await asyncio.gather(*(d.send(t, sample_notification()) for t in targets)))

    assert asyncio.run(go()) == [False, False]
    assert len(webhook_server.received) == 6  # 3 attempts each: 503, 429, then a final 400
    logging.getLogger("c4stream.test").info("config: %r / %s", cfg, cfg.destination[0])
    text = caplog.text
    assert "not delivered" in text and "retry" in text  # the logging under test did happen
    for secret in (*SECRETS.values(), "tok-ding-123", "/dingtalk", "/feishu"):
        assert secret not in text
    signs = [r.query.get("sign") or (r.json.get("sign")) for r in webhook_server.received]
    assert all(signs) and not any(s in text or quote_plus(s) in text for s in signs)
