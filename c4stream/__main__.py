"""``python -m c4stream`` is the ``c4stream`` command (used to start child services)."""

from c4stream.cli import main

main()
