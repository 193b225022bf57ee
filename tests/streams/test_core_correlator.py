"""HostCorrelator policy: minimum evidence, cool-down, cap, deny list, dry run, stable ids."""

from __future__ import annotations

import pytest

from streams.commands import encode_command
from streams.core import HostCorrelator, PolicyConfig
from streams.verdicts import Verdict

W = 5_000_000


def straggler(host: str, window: int, comm: str = "0xa", gpu: int = 3, score: float = 0.9,
              hosts: int = 16) -> Verdict:  # fmt: skip
    return Verdict(id=f"{host}{window}{comm}", ts_us=(window + 1) * W, job="j", comm=comm,
                   host=host, gpu=gpu, fault="straggler", score=score, reason="r",
                   window_start_us=window * W, window_end_us=(window + 1) * W,
                   evidence={"collectives": 12, "last_frac": 0.9, "peer_time_x": 3.0,
                             "late_ms": 20.0, "comm_hosts": hosts, "comm_name": "tp"})  # fmt: skip


def feed(c: HostCorrelator, vs: list[Verdict]) -> list:
    out = []
    for v in vs:
        out += c.observe(v)
    return out


@pytest.mark.timeout(10)
def test_one_window_is_not_enough_two_are() -> None:
    c = HostCorrelator(PolicyConfig())
    assert c.observe(straggler("node-001", 1)) == []
    [cmd] = c.observe(straggler("node-001", 2))
    assert (cmd.host, cmd.gpu, cmd.fault, cmd.action, cmd.dry_run) == (
        "node-001", 3, "straggler", "cordon", True,
    )  # fmt: skip
    assert cmd.reason.startswith("node-001 GPU 3 is a straggler: it arrived last in 90% of 24")
    assert cmd.evidence["windows"] == 2 and cmd.evidence["communicators"] == ["tp"]
    assert encode_command(cmd).startswith(b'{"v":1,"kind":"isolate"')


@pytest.mark.timeout(10)
def test_same_fault_again_gives_the_same_id_and_restart_resumes() -> None:
    vs = [straggler("node-001", w) for w in (1, 2, 3)]
    a = feed(HostCorrelator(PolicyConfig()), vs)
    c = HostCorrelator(PolicyConfig())
    b = []
    for v in vs:
        b += c.observe(v)
        c = HostCorrelator.from_bytes(c.to_bytes(), PolicyConfig())
    assert [x.id for x in a] == [x.id for x in b] and len(a) == 1  # cool-down: decided once
    # replaying from scratch decides the same id again
    assert feed(HostCorrelator(PolicyConfig()), vs)[0].id == a[0].id


@pytest.mark.timeout(10)
def test_deny_list_and_no_dry_run() -> None:
    c = HostCorrelator(PolicyConfig(deny_hosts=["node-001"], dry_run=False))
    [cmd] = feed(c, [straggler("node-001", 1), straggler("node-001", 2)])
    assert cmd.action == "alert_only" and cmd.dry_run is False
    assert "deny list" in cmd.reason


@pytest.mark.timeout(10)
def test_cap_on_fraction_of_hosts_isolated_per_hour() -> None:
    c = HostCorrelator(PolicyConfig(max_isolated_frac=0.25))  # 16 hosts -> 4 per hour
    cmds = []
    for h in range(6):
        cmds += feed(c, [straggler(f"node-{h:03d}", 1), straggler(f"node-{h:03d}", 2)])
    actions = [x.action for x in cmds]
    assert actions == ["cordon"] * 4 + ["alert_only"] * 2
    assert "cap 4" in cmds[-1].reason


@pytest.mark.timeout(10)
def test_victim_waiting_elsewhere_is_not_blamed() -> None:
    c = HostCorrelator(PolicyConfig())
    note = Verdict(id="n", ts_us=2 * W, job="j", comm="0xdp", host="node-001", fault="straggler",
                   score=0.0, reason="waits", window_start_us=W, window_end_us=2 * W,
                   evidence={"role": "waiting", "gpus": [3], "extra_ms": [60.0]},
                   benign=True)  # fmt: skip
    assert c.observe(note) == []
    assert feed(c, [straggler("node-001", 1), straggler("node-001", 2)]) == []


@pytest.mark.timeout(10)
def test_hang_waits_for_settle_then_picks_the_host_when_many_gpus_silent() -> None:
    c = HostCorrelator(PolicyConfig())
    vs = [
        Verdict(
            id=f"h{g}",
            ts_us=10 * W,
            job="j",
            comm=f"0xdp{g}",
            host="node-007",
            gpu=g,
            fault="noncomm_hang",
            score=0.9,
            reason="r",
            window_start_us=9 * W,
            window_end_us=10 * W,
            evidence={"silent": True, "target_collective": 40, "wait_s": 3.0, "comm_hosts": 16},
        )  # fmt: skip
        for g in range(4)
    ]
    assert feed(c, vs) == []  # settle: let every communicator be heard
    [cmd] = c.advance(10 * W + 2_000_000)
    assert (cmd.host, cmd.gpu, cmd.fault) == ("node-007", None, "noncomm_hang")
    assert "went silent" in cmd.reason


def _hang(gpu: int | None, ts: int, benign: bool = False, evidence: dict | None = None) -> Verdict:
    ev = evidence or {"silent": False, "target_collective": 40, "wait_s": 2.7, "comm_hosts": 16}
    return Verdict(id=f"h{gpu}{ts}", ts_us=ts, job="j", comm=f"0xdp{gpu}", host="node-008",
                   gpu=gpu, fault="noncomm_hang", score=0.0 if benign else 0.9, reason="r",
                   window_start_us=9 * W, window_end_us=ts, evidence=ev,
                   benign=benign)  # fmt: skip


@pytest.mark.timeout(10)
def test_host_down_names_the_host_when_its_other_gpus_go_silent() -> None:
    """GPU 1 is blamed first (its peers wait for it); the host's other GPUs are then
    noted silent where nobody waits for them: the command names the host, not GPU 1."""
    c = HostCorrelator(PolicyConfig())
    t = 10 * W
    assert c.observe(_hang(1, t)) == []
    assert c.advance(t + 2_000_000) == []  # past settle, but one GPU: wait for the host
    for g in (0, 2, 3):
        note = {"role": "silent", "gpus": [g], "silent_s": 4.0, "comm_hosts": 16}
        assert c.observe(_hang(None, t + 2_500_000, benign=True, evidence=note)) == []
    [cmd] = c.advance(t + 2_600_000)
    assert (cmd.host, cmd.gpu, cmd.fault) == ("node-008", None, "noncomm_hang")
    assert cmd.reason.startswith("node-008 went silent: 4 GPUs (0, 1, 2, 3) stopped")


@pytest.mark.timeout(10)
def test_one_hung_gpu_is_named_after_the_host_wait() -> None:
    c = HostCorrelator(PolicyConfig())
    t = 10 * W
    assert c.observe(_hang(1, t)) == []
    assert c.advance(t + 2_900_000) == []
    [cmd] = c.advance(t + 3_000_000)
    assert (cmd.host, cmd.gpu) == ("node-008", 1)
    assert "GPU 1 hangs" in cmd.reason


def hang(host: str, ts: int, gpu: int = 1, hosts: int = 16) -> Verdict:
    return Verdict(id=f"h{host}{ts}", ts_us=ts, job="j", comm=f"tp-{host}", host=host, gpu=gpu,
                   fault="noncomm_hang", score=0.9, reason="r", window_start_us=ts - W,
                   window_end_us=ts, evidence={"target_collective": 74, "wait_s": 2.6,
                                               "comm_hosts": hosts}, ranks=[gpu])  # fmt: skip


@pytest.mark.timeout(10)
def test_hangs_on_many_hosts_at_once_are_a_job_wide_stop_not_a_fault() -> None:
    # A long checkpoint: GPUs on 9 of 16 hosts look hung within the same second; the
    # settle time (default 1.5 s) lets all of them be heard before anything is decided.
    c = HostCorrelator(PolicyConfig())
    t = 30 * W
    cmds = feed(c, [hang(f"node-{i:03d}", t + i * 100_000) for i in range(9)])
    cmds += c.advance(t + W)
    assert cmds and all(x.action == "alert_only" for x in cmds)
    assert "job-wide stop" in cmds[-1].reason and "9 of 16 hosts" in cmds[-1].reason


@pytest.mark.timeout(10)
def test_one_hung_host_among_many_healthy_ones_is_isolated() -> None:
    c = HostCorrelator(PolicyConfig(hang_settle_us=0, host_wait_us=0))
    [cmd] = feed(c, [hang("node-004", 30 * W)])
    assert cmd.action == "cordon_and_taint" and "job-wide" not in cmd.reason


@pytest.mark.timeout(10)
def test_census_notes_size_the_job_for_the_cap() -> None:
    # Two pipeline stages: each data-parallel ring spans 8 of the job's 16 hosts, and the
    # hang verdicts come from intra-host communicators. The job's size is the union of
    # the census notes (16 hosts: cap 4 per hour), not the largest communicator (8: cap 2).
    c = HostCorrelator(PolicyConfig(hang_settle_us=0, host_wait_us=0))
    hosts = [f"node-{i:03d}" for i in range(16)]
    for stage, names in enumerate((hosts[:8], hosts[8:])):
        census = Verdict(id=f"census{stage}", ts_us=W, job="j", comm=f"dp-s{stage}",
                         host=names[0], fault="noncomm_hang", score=0.0, reason="census",
                         window_start_us=0, window_end_us=W, benign=True,
                         evidence={"role": "census", "hosts": names, "comm_hosts": 8})  # fmt: skip
        assert c.observe(census) == []
    cmds = []
    for i, host in enumerate(("node-001", "node-009", "node-012")):
        cmds += feed(c, [hang(host, (30 + 10 * i) * W, hosts=1)])
    assert [x.action for x in cmds] == ["cordon_and_taint"] * 3
    assert c.job_hosts["j"] == 16


@pytest.mark.timeout(10)
def test_a_host_late_on_every_rail_waits_for_the_communicator_inside_it() -> None:
    """A slow GPU holds its host-mates up: the host is late in every DP rail, each
    naming another GPU. Only the host's own (tensor-parallel) communicator names the
    GPU; without it, after two more windows, the command names the host."""
    rails = [straggler("node-006", w, comm=f"rail{g}", gpu=g) for w in (1, 2) for g in range(8)]
    c = HostCorrelator(PolicyConfig())
    assert feed(c, rails) == []  # two windows, eight GPUs alike: not told apart yet
    tp = straggler("node-006", 3, comm="tp", gpu=1, hosts=1)
    [cmd] = feed(c, [tp])
    assert (cmd.host, cmd.gpu) == ("node-006", 1)

    c = HostCorrelator(PolicyConfig())
    later = [straggler("node-006", w, comm=f"rail{g}", gpu=g) for w in (3, 4) for g in range(8)]
    [cmd] = feed(c, rails + later)
    assert (cmd.host, cmd.gpu) == ("node-006", None)
    assert "no communicator inside the host names one GPU" in cmd.reason
