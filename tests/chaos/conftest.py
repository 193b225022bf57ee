"""The chaos suite prints its summary table at the end of the session."""

from __future__ import annotations

import pytest

from tests.chaos.harness import ROWS, table


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos_long: the long chaos variants (CI runs them too: not deselected)"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ROWS:
        terminalreporter.write_sep("=", "chaos summary (issue 12)")
        terminalreporter.write(table())
