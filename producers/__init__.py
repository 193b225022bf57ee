"""Producers: the event contract, trace files, the simulator, exporters and replay.

This package owns ``collective-event`` version 1 (``shared/contracts``); everything
downstream imports the event types from :mod:`producers.events`.
"""
