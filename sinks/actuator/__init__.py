"""The isolation actuator: ``c4stream actuate`` turns isolation commands into actions.

Stages, one module each:

- :mod:`sinks.actuator.config` — the one typed configuration object;
- :mod:`sinks.actuator.policy` — whether a command may act (alert-only, deny list,
  dry-run, already done);
- :mod:`sinks.actuator.backends` — what every backend promises, and the error policy;
- :mod:`sinks.actuator.kubernetes_backend` — cordon + taint + condition + Event;
- :mod:`sinks.actuator.command_backend` — a scheduler command (e.g. Slurm's ``scontrol``);
- :mod:`sinks.actuator.ledger` — the durable idempotency store (SQLite);
- :mod:`sinks.actuator.consumer` — the Kafka loop (decode, act, record, commit).

Importing this package has no side effects and does not import the Kubernetes client.
"""
