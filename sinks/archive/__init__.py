"""Crash-safe Parquet archive of events, verdicts and isolation commands.

``schemas`` (explicit Arrow schemas, dedupe key) · ``tables`` (decoded records → Arrow
columns) · ``writer`` (rolling files: temp → fsync → rename) · ``consumer`` (Kafka
loop, commit policy) · ``dedupe`` (count/remove duplicates, open the datasets) ·
``cli`` (``c4stream archive``). Usage and example queries: ``docs/archive.md``.

Importing this package loads nothing heavy; the submodules import pyarrow.
"""
