"""Shared pytest setup. Add new fixtures in their own section below; keep each small.

Kafka: tests that need a broker take the ``kafka_bootstrap`` fixture (and usually
``make_topics``) and carry ``@pytest.mark.kafka``. One broker serves the whole
session: ``KAFKA_BOOTSTRAP`` if set, else Docker when C4STREAM_USE_DOCKER=1, else a
local Java broker (see compose/local_broker.py). Deselect with ``-m "not kafka"``.
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
