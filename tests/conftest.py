"""Shared pytest setup. Add new fixtures in their own section below; keep each small.

Kafka: tests that need a broker take the ``kafka_bootstrap`` fixture (and usually
``make_topics``). One broker serves the whole session: ``KAFKA_BOOTSTRAP`` if set, else
Docker when C4STREAM_USE_DOCKER=1, else a local Java broker (see
compose/local_broker.py). Deselect with ``-m "not kafka"``.

Tiers: the markers of pyproject.toml are applied here, by the fixtures a test uses and
the directory it lives in (:func:`pytest_collection_modifyitems`), so a new test is
tiered without a decorator; ``./run check`` runs what carries none of them.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator, Mapping

import pytest

from compose.local_broker import broker_for_tests, create_topics

# Real Slurm (munged + slurmctld + one slurmd): the ``slurm_cluster`` fixture.
# A real Kubernetes API server (etcd, kube-apiserver, controllers): ``kube_cluster``.
pytest_plugins = ["tests.slurm_fixture", "tests.k8s_fixture"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kafka: needs a Kafka broker (kafka_bootstrap fixture)")


# --------------------------------------------------------------------------- tiers

FIXTURE_MARKS = {
    "kafka_bootstrap": "kafka",  # make_topics and every Kafka helper fixture take it
    "slurm_cluster": "slurm",
    "alertmanager": "alertmanager",
    "promtool": "promtool",
    "kube_cluster": "kubernetes",
}
"""A test that uses the fixture (directly or through another fixture) needs what it
starts, and gets the marker."""
PATH_MARKS = {
    "tests/chaos/": ("chaos",),
    "tests/bench/": ("slow",),
    # Simulated jobs judged two ways and compared, end to end through the detect and
    # worker paths: 10-60 s per test on 2 shared cores (pytest --durations).
    "tests/streams/test_core_group.py": ("slow",),
    "tests/streams/test_core_columns.py": ("slow",),
    "tests/streams/test_detector_contract.py": ("slow",),
    "tests/streams/test_detect_archive.py": ("slow",),
    "tests/streams/test_detect_ipc.py": ("slow",),
    "tests/streams/test_quality_sim.py": ("slow",),
    "tests/streams/test_worker_arrow.py": ("slow",),
    "tests/streams/test_worker_grouped.py": ("slow",),
    # pipeline shapes simulated and checked (0.6-5 s each, ~25 s in all)
    "tests/producers/test_simulator_shapes.py": ("slow",),
    # services started without a broker, waiting out their broker timeouts; a receiver
    # that answers late, waited out
    "tests/sinks/test_sink_operability.py": ("slow",),
    "tests/sinks/test_alert_slow_receiver.py": ("slow",),
}
"""Every test under the directory (or in the file) gets the markers. A test that takes
more than a few seconds without needing any of the above carries ``@pytest.mark.slow``
itself (or its file is listed here): the fast tier must stay under a minute."""


SHARED_GROUPS = {"kube_cluster": "kubernetes"}
"""Session fixtures too costly to start once per xdist worker (a kube-apiserver with etcd
and controllers): every test that uses one runs on the same worker (``--dist loadgroup``,
as ``./run test`` runs the suite)."""


# tryfirst: xdist's own hook reads the ``xdist_group`` marks right after this one.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in FIXTURE_MARKS:
                item.add_marker(FIXTURE_MARKS[fixture])
        rel = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        for prefix, marks in PATH_MARKS.items():
            if rel.startswith(prefix):
                for mark in marks:
                    item.add_marker(mark)
        group = _worker_group(item, rel)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def _worker_group(item: pytest.Item, rel: str) -> str | None:
    """The xdist group of a test: the shared session fixture it uses, else its module
    when it uses a module-scoped fixture (a simulated trace, a worker fed once: computed
    once, on one worker), else none (spread freely)."""
    names = getattr(item, "fixturenames", ())
    for fixture, group in SHARED_GROUPS.items():
        if fixture in names:
            return group
    info = getattr(item, "_fixtureinfo", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, defs in info.name2fixturedefs.items() if info else ():
        if defs and defs[-1].scope == "module":
            module = rel or item.nodeid.split("::")[0]
            # a parametrised module fixture is one instance per parameter: one group each
            # (no "[", "]" or "@" in a group: xdist reads the group after the last "@"
            # only when no "]" follows it)
            return (
                f"{module}:{re.sub(r'[][@]', '_', str(params[name]))}" if name in params else module
            )
    return None


# --------------------------------------------------------------------------- Kafka


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``host:port`` of a Kafka broker shared by the whole test session."""
    with broker_for_tests() as bootstrap:
        yield bootstrap


MakeTopics = Callable[..., dict[str, str]]


@pytest.fixture
def make_topics(kafka_bootstrap: str, request: pytest.FixtureRequest) -> MakeTopics:
    """Factory: ``make_topics({"events": 3, "verdicts": 1})`` -> ``{"events": "<unique>", ...}``.

    Names get the test's name and a random suffix so tests sharing the session
    broker never see each other's messages. Partition counts are explicit.
    """
    test = re.sub(r"[^A-Za-z0-9._-]", "_", request.node.name)[:100]

    def make(topics: Mapping[str, int], timeout: float = 30.0) -> dict[str, str]:
        suffix = uuid.uuid4().hex[:8]
        names = {key: f"{test}.{key}.{suffix}" for key in topics}
        create_topics(kafka_bootstrap, {names[k]: n for k, n in topics.items()}, timeout)
        return names

    return make
