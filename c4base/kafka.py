"""Kafka connection settings shared by every stage.

Security settings (SASL, TLS) pass through untouched as librdkafka properties in
``extra``; :meth:`KafkaConfig.aiokafka_kwargs` maps the common ones for Faust.
"""

from __future__ import annotations

import os
import re
from typing import Any

import msgspec
from confluent_kafka import KafkaError

__all__ = ["KafkaConfig", "KafkaCredentialsError", "credentials_refused"]

#: What librdkafka says when the broker refuses who we are: SASL (wrong user or
#: password, or a mechanism the listener does not offer) and TLS (no client certificate
#: where one is required, an untrusted one, or a broker certificate we do not trust).
#: A refused certificate arrives as a transport error, hence the text match.
_REFUSED = re.compile(
    r"SASL authentication|Authentication failed|SSL handshake failed|ssl/tls alert"
    r"|certificate verify failed|certificate required|Unsupported SASL mechanism",
    re.IGNORECASE,
)


class KafkaCredentialsError(RuntimeError):
    """The broker refused this service's credentials (SASL or TLS client certificate).

    Not transient: retrying with the same settings cannot help, so services stop with a
    non-zero status and this message (librdkafka's words; they never contain the
    password). Fix ``[kafka.extra]`` (``sasl.*``, ``ssl.*``) or the broker's users.
    """


def credentials_refused(err: KafkaError) -> bool:
    """Whether a librdkafka error says the broker refused our credentials.

    >>> credentials_refused(KafkaError(KafkaError._AUTHENTICATION, "bad"))
    True
    >>> credentials_refused(KafkaError(KafkaError._TRANSPORT, "Receive failed: "
    ...     "error:0A000412:SSL routines::ssl/tls alert bad certificate"))
    True
    >>> credentials_refused(KafkaError(KafkaError._TRANSPORT, "Connection refused"))
    False
    """
    return err.code() == KafkaError._AUTHENTICATION or bool(_REFUSED.search(err.str()))


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
