"""Explicit Arrow schemas of the three archived datasets: events, verdicts, isolations.

Written once here so every file of a dataset has the same columns and types, whatever
the first batch happened to hold (inferred schemas drift: a batch without ``gpu``
would make it ``null`` typed and the next file would disagree).

Layout rules shared by all three:

* ``job`` and ``hour`` are **not** columns of the files: they are the hive partition
  directories (``job=<job>/hour=2026-11-29T20/``), as pyarrow and DuckDB expect; the
  readers add them back as string columns.
* Every row carries where it came from: ``kafka_topic``, ``kafka_partition``,
  ``kafka_offset`` and ``kafka_index`` (the position of the event inside its Kafka
  message, 0 for verdicts and commands). That quadruple is the **dedupe key**
  (:data:`DEDUPE_KEY`): it is unique per produced event and exact, whereas a natural
  key such as (comm, rank, seq) has none for progress heartbeats that repeat a count.
* ``kafka_ts_ms`` is the broker timestamp of the message (for latency studies).
* Free-form ``evidence`` dictionaries are stored as JSON text; query them with
  DuckDB's ``json_extract`` or ``json.loads``.

>>> [f.name for f in EVENTS.field("conns").type.value_type]
['peer', 'dir', 'bytes', 'time_us', 'retrans']
>>> [n for n in DEDUPE_KEY]
['kafka_topic', 'kafka_partition', 'kafka_offset', 'kafka_index']
>>> sorted(SCHEMAS)
['events', 'isolations', 'verdicts']
"""

from __future__ import annotations

import pyarrow as pa

from producers.columnar.schema import ARCHIVE_EVENT_SCHEMA, CONN_TYPE, ORIGIN, SOURCE_FIELDS

__all__ = [
    "CONN",
    "DEDUPE_KEY",
    "EVENTS",
    "ISOLATIONS",
    "PARTITIONING",
    "PARTITION_COLUMNS",
    "SCHEMAS",
    "SOURCE_FIELDS",
    "VERDICTS",
]

#: Hive partition columns (directories, not file columns), in directory order.
PARTITION_COLUMNS = ("job", "hour")

#: Explicit partition schema for readers: keeps ``job=123`` a string, not an int.
PARTITIONING = pa.schema([("job", pa.string()), ("hour", pa.string())])

#: Where a row came from; the four together identify one produced record exactly.
DEDUPE_KEY = ORIGIN
#: One connection of a rank with a peer: the wire's own type (``producers.columnar``).
CONN = CONN_TYPE
#: One row per event: the events' column schema (``producers.columnar.schema``).
EVENTS = ARCHIVE_EVENT_SCHEMA
#: One row per verdict (``streams.verdicts.Verdict``).
VERDICTS = pa.schema(
    [
        pa.field("v", pa.int16(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("ts_us", pa.int64(), nullable=False),
        pa.field("comm", pa.string(), nullable=False),
        pa.field("host", pa.string(), nullable=False),
        pa.field("fault", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("window_start_us", pa.int64(), nullable=False),
        pa.field("window_end_us", pa.int64(), nullable=False),
        pa.field("evidence", pa.string(), nullable=False),  # JSON text
        pa.field("ranks", pa.list_(pa.int32())),
        pa.field("gpu", pa.int32()),
        pa.field("nic", pa.string()),
        pa.field("peer_host", pa.string()),
        pa.field("benign", pa.bool_(), nullable=False),
        *SOURCE_FIELDS,
    ]
)

#: One row per isolation command (``streams.commands.IsolationCommand``).
ISOLATIONS = pa.schema(
    [
        pa.field("v", pa.int16(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("ts_us", pa.int64(), nullable=False),
        pa.field("host", pa.string(), nullable=False),
        pa.field("fault", pa.string(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("confidence", pa.float64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("evidence", pa.string(), nullable=False),  # JSON text
        pa.field("gpu", pa.int32()),
        pa.field("nic", pa.string()),
        pa.field("peer_host", pa.string()),
        pa.field("dry_run", pa.bool_()),
        *SOURCE_FIELDS,
    ]
)

SCHEMAS: dict[str, pa.Schema] = {"events": EVENTS, "verdicts": VERDICTS, "isolations": ISOLATIONS}
