"""c4stream: find the faulty GPU, NIC, link or process of a training job from its
collective-communication telemetry.

This package is the top of the layers: the command-line front end and the demo, which
wire the stages together (``producers`` → ``streams`` → ``sinks``, all standing on
``c4base``, what every stage shares).
"""

__version__ = "0.1.0"
