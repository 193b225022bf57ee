"""The chaos suite prints its summary table at the end of the session."""

from __future__ import annotations

import pytest

from tests.chaos.harness import ROWS, table


def pytest_configure(config: pytest.Config) -> None:
    # CI runs them: `./run test` deselects nothing; `-m "not chaos_long"` skips them.
    config.addinivalue_line(
        "markers", "chaos_long: the long chaos variants (worker and broker restarts)"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ROWS:
        terminalreporter.write_sep("=", "chaos summary (issue 12)")
        terminalreporter.write(table())
