"""Kafka connection settings shared by every stage.

Security settings (SASL, TLS) pass through untouched as librdkafka properties in
``extra``; :meth:`KafkaConfig.aiokafka_kwargs` maps the common ones for Faust.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

__all__ = ["KafkaConfig"]


class KafkaConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bootstrap: str = "127.0.0.1:9092"
    """host:port[,host:port]; the environment variable KAFKA_BOOTSTRAP overrides it."""
    topic_prefix: str = ""
    extra: dict[str, str] = {}
    """librdkafka properties passed through, e.g. security.protocol, sasl.mechanism."""

    def resolved_bootstrap(self) -> str:
        return os.environ.get("KAFKA_BOOTSTRAP") or self.bootstrap

    def producer_config(self, **overrides: Any) -> dict[str, Any]:
        """confluent-kafka producer settings: idempotent, compressed, batched."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.resolved_bootstrap(),
            "enable.idempotence": True,
            "compression.type": "zstd",
            "linger.ms": 20,
            **self.extra,
        }
        conf.update(overrides)
        return conf

    def consumer_config(self, group: str, **overrides: Any) -> dict[str, Any]:
        """confluent-kafka consumer settings; offsets are committed by the caller."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.resolved_bootstrap(),
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            **self.extra,
        }
        conf.update(overrides)
        return conf

    def client_config(self) -> dict[str, Any]:
        """Settings any confluent-kafka client needs (admin, probes): bootstrap + security."""
        return {"bootstrap.servers": self.resolved_bootstrap(), **self.extra}

    def aiokafka_kwargs(self) -> dict[str, Any]:
        """The subset of ``extra`` that Faust/aiokafka understands, under its names."""
        mapping = {
            "security.protocol": "security_protocol",
            "sasl.mechanism": "sasl_mechanism",
            "sasl.username": "sasl_plain_username",
            "sasl.password": "sasl_plain_password",
            "ssl.ca.location": "ssl_cafile",
            "ssl.certificate.location": "ssl_certfile",
            "ssl.key.location": "ssl_keyfile",
            "ssl.key.password": "ssl_password",
            "ssl.endpoint.identification.algorithm": "ssl_check_hostname",
        }
        return {mapping[k]: v for k, v in self.extra.items() if k in mapping}
