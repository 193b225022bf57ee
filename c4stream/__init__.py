"""c4stream: find the faulty GPU, NIC, link or process of a training job from its
collective-communication telemetry.

This package holds what every stage shares (topic names, the typed configuration,
dead-letter records) and the command-line front end that wires the stages together:
``producers`` → ``streams`` → ``sinks``.
"""

__version__ = "0.1.0"
