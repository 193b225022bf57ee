"""Finding the Go tools ``./run`` builds once and caches (Alertmanager, promtool).

``./run`` puts them in ``$C4STREAM_TOOLS_BIN`` or ``~/.cache/c4stream/bin`` and on PATH;
a test that needs one and finds none skips, naming how to get it.
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


def tool_path(name: str) -> str | None:
    """The tool's path: PATH first, then the cache ``./run`` builds into."""
    found = shutil.which(name)
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
        pytest.skip(f"{name} not found: `./run test` builds it once with go install (needs Go)")
    return path
