"""``make_app(config)``: the Faust app of the worker, built on demand (none at import).

Settings that avoid faust-streaming's known traps: raw (bytes) serializers with our own
msgspec decoding; ``store="memory://"`` (tables are rebuilt from their changelog topics,
which :mod:`streams.app.topics_admin` pre-creates with the right partition counts); no
windowed tables (windows live in the detection core, in event time); the web server off
or bound to 127.0.0.1; short session/rebalance timeouts and no recovery delay.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from c4base.collector import tune_collector
from streams.app.agents import WorkerParts, register_agents
from streams.app.engine import CoreEngine, Engine
from streams.app.faust_adapter import install_guarded_transport
from streams.app.settings import WorkerConfig

__all__ = ["make_app"]


def broker_url(bootstrap: str) -> str:
    """Faust's broker URL for a ``host:port[,host:port]`` bootstrap list.

    >>> broker_url("127.0.0.1:9092,k2:9092")
    'kafka://127.0.0.1:9092;kafka://k2:9092'
    """
    return ";".join(f"kafka://{hp.strip()}" for hp in bootstrap.split(",") if hp.strip())


class WorkerSecurityError(ValueError):
    """The worker's Kafka security settings (``[kafka.extra]``) are inconsistent."""


def ssl_context(kw: dict[str, Any]) -> ssl.SSLContext:
    """A client TLS context from librdkafka-named settings mapped by ``aiokafka_kwargs``:
    CA file (else the system's), client certificate and key (mutual TLS), and host name
    checking unless ``ssl.endpoint.identification.algorithm`` is ``none``."""
    ctx = ssl.create_default_context(cafile=kw.get("ssl_cafile"))
    if kw.get("ssl_certfile"):
        ctx.load_cert_chain(kw["ssl_certfile"], kw.get("ssl_keyfile"), kw.get("ssl_password"))
    if str(kw.get("ssl_check_hostname", "https")).lower() == "none":
        ctx.check_hostname = False
    return ctx


def worker_credentials(config: WorkerConfig) -> Any:
    """Faust broker credentials for ``security.protocol`` (PLAINTEXT, SSL, SASL_PLAINTEXT,
    SASL_SSL) as every other service reads it from ``[kafka.extra]``; None: plaintext.

    The worker used to pass SASL credentials only and ignore ``security.protocol``: it
    could not reach a TLS-only broker, and SASL passwords went over plaintext.
    """
    import faust  # optional heavy dependency, loaded with the worker only

    kw = config.kafka.aiokafka_kwargs()
    protocol = str(kw.get("security_protocol", "PLAINTEXT")).upper()
    if protocol not in ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"):
        raise WorkerSecurityError(f"security.protocol {protocol!r} is not supported")
    sasl = protocol.startswith("SASL_")
    if sasl and "sasl_plain_username" not in kw:
        raise WorkerSecurityError(f"security.protocol {protocol} needs sasl.username")
    if not sasl and "sasl_plain_username" in kw:
        raise WorkerSecurityError(
            f"sasl.username is set but security.protocol is {protocol}: "
            "say SASL_SSL (or SASL_PLAINTEXT on a trusted network)"
        )
    ctx = ssl_context(kw) if protocol.endswith("SSL") else None
    if sasl:
        return faust.SASLCredentials(
            username=kw["sasl_plain_username"],
            password=kw.get("sasl_plain_password", ""),
            mechanism=kw.get("sasl_mechanism", "PLAIN"),
            ssl_context=ctx,
        )
    if ctx is not None:
        return faust.SSLCredentials(ctx)
    return None


def make_app(config: WorkerConfig, engine: Engine | None = None, metrics: Any = None) -> Any:
    """Build the worker's ``faust.App``; ``app.c4_parts`` holds its state for status/tests.

    ``metrics``: a :class:`c4base.metrics.Metrics` to count into (served by the caller).
    """
    import faust

    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        config.group_id(),
        broker=broker_url(config.kafka.resolved_bootstrap()),
        broker_credentials=worker_credentials(config),
        store="memory://",
        datadir=str(workdir / "faust"),
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=config.events_partitions,
        topic_replication_factor=config.replication_factor,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=config.session_timeout_s,
        broker_heartbeat_interval=config.heartbeat_interval_s,
        broker_rebalance_timeout=config.rebalance_timeout_s,
        broker_commit_interval=config.commit_interval_s,
        stream_recovery_delay=config.recovery_delay_s,
        web_enabled=config.web_enabled,
        web_bind="127.0.0.1",
        web_host="127.0.0.1",
        web_port=config.web_port,
        autodiscover=False,
        broker_max_poll_records=config.max_poll_records,
        stream_buffer_maxsize=config.stream_buffer_maxsize,
        consumer_max_fetch_size=config.fetch_max_partition_bytes,
    )
    install_guarded_transport(app)  # before register_agents declares topics
    parts: WorkerParts = register_agents(
        app, config, engine or CoreEngine(config.detect, config.policy), metrics
    )
    app.c4_parts = parts
    # The start-up objects (modules, Faust's app) live as long as the process: frozen,
    # the collector no longer walks them; and it runs less often (see the setting).
    tune_collector(config.gc_gen0_threshold)
    return app
