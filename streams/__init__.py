"""Streams: the detection core (plain Python, no Kafka inside) and the Faust app around it.

This package owns the verdict and isolation-command contracts
(:mod:`streams.verdicts`, :mod:`streams.commands`). It imports the event contract
from :mod:`producers.events`; it never imports :mod:`sinks`.
"""
