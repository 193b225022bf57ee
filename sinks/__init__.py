"""Sinks: what the pipeline decides reaches the cluster (actuator), the archive
(Parquet) and the people on call (chat alerts). Imports the command contract from
:mod:`streams.commands`; nothing imports sinks.
"""
