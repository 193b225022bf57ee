"""Finding Alertmanager and promtool for the tests that run them.

``./run test`` installs them from Debian's packages (``prometheus`` has promtool,
``prometheus-alertmanager`` the Alertmanager); with ``C4STREAM_GO_TOOLS=1`` it builds
newer releases once with ``go install`` into ``$C4STREAM_TOOLS_BIN`` (default
``~/.cache/c4stream/bin``) and puts that first on PATH. A test that needs one and finds
none skips, naming how to get it.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

__all__ = ["free_port", "require_tool", "tool_path"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a daemon a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PACKAGED_AS = {"alertmanager": "prometheus-alertmanager"}
"""Debian's name of a tool's program (its package ``prometheus-alertmanager``)."""


def tool_path(name: str) -> str | None:
    """The tool's path: PATH first (also under its Debian name), then the cache
    ``./run`` builds into when asked to (``C4STREAM_GO_TOOLS=1``)."""
    found = shutil.which(name) or (name in PACKAGED_AS and shutil.which(PACKAGED_AS[name]))
    if found:
        return found
    cache = os.environ.get("C4STREAM_TOOLS_BIN") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "c4stream" / "bin"
    )
    candidate = Path(cache) / name
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


def require_tool(name: str) -> str:
    """The tool's path, or skip the test saying how to get it."""
    path = tool_path(name)
    if path is None:
        pytest.skip(
            f"{name} not found: `./run test` installs it (apt: prometheus, "
            "prometheus-alertmanager), or C4STREAM_GO_TOOLS=1 ./run test builds it with Go"
        )
    return path
