"""``make_app(config)``: the Faust app of the worker, built on demand (none at import).

Settings that avoid faust-streaming's known traps: raw (bytes) serializers with our own
msgspec decoding; ``store="memory://"`` (tables are rebuilt from their changelog topics,
which :mod:`streams.app.topics_admin` pre-creates with the right partition counts); no
windowed tables (windows live in the detection core, in event time); the web server off
or bound to 127.0.0.1; short session/rebalance timeouts and no recovery delay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streams.app.agents import WorkerParts, register_agents
from streams.app.engine import CoreEngine, Engine
from streams.app.settings import WorkerConfig

__all__ = ["make_app"]


def broker_url(bootstrap: str) -> str:
    """Faust's broker URL for a ``host:port[,host:port]`` bootstrap list.

    >>> broker_url("127.0.0.1:9092,k2:9092")
    'kafka://127.0.0.1:9092;kafka://k2:9092'
    """
    return ";".join(f"kafka://{hp.strip()}" for hp in bootstrap.split(",") if hp.strip())


def _credentials(config: WorkerConfig) -> Any:
    kw = config.kafka.aiokafka_kwargs()
    if "sasl_plain_username" not in kw:
        return None
    import faust

    return faust.SASLCredentials(
        username=kw["sasl_plain_username"],
        password=kw.get("sasl_plain_password", ""),
        mechanism=kw.get("sasl_mechanism", "PLAIN"),
    )


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
        broker_credentials=_credentials(config),
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
    parts: WorkerParts = register_agents(
        app, config, engine or CoreEngine(config.detect, config.policy), metrics
    )
    app.c4_parts = parts
    return app
