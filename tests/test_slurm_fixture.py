"""The Slurm test cluster itself: the daemons answer, drains stick, a job runs and requeues."""

from __future__ import annotations

import pytest

from tests.slurm_fixture import SlurmCluster, runuser_available

pytestmark = pytest.mark.timeout(90)


def test_cluster_drains_a_node_without_slurmd_and_runs_a_job(slurm_cluster: SlurmCluster) -> None:
    c = slurm_cluster
    assert "is UP" in c.scontrol("ping").stdout
    c.drain("node-003", "RMA ticket 1234")
    n3 = c.node("node-003")
    assert "DRAIN" in n3["State"].split("+")
    assert n3["Reason"].startswith("RMA ticket 1234")
    assert "DRAIN" not in c.node("node-002")["State"]
    if c.compute_node is None:
        pytest.skip("no slurmd (not root): jobs cannot run")
    job = c.sbatch("sleep 120")
    assert c.wait_job_state(job, "RUNNING") == "RUNNING"
    c.scontrol("requeue", job)
    assert c.job(job)["Restarts"] == "1"


@pytest.mark.skipif(not runuser_available(), reason="needs root and runuser")
def test_a_non_admin_user_cannot_drain(slurm_cluster: SlurmCluster) -> None:
    res = slurm_cluster.run(
        "scontrol",
        "update",
        "nodename=node-002",
        "state=drain",
        "reason=x",
        user="nobody",
        check=False,
    )
    assert res.returncode != 0 and "Invalid user id" in res.stderr
    assert "DRAIN" not in slurm_cluster.node("node-002")["State"]
