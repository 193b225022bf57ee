"""The cluster simulator: contract, determinism, batching, ring model and every fault.

Each test reads the syndrome a detector would read, from the events themselves.
Traces are small (at most 128 GPUs, at most 45 simulated seconds), so the module
runs in a few seconds.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import cache
from pathlib import Path

import jsonschema
import msgspec
import numpy as np
import pytest

from producers.events import OpEvent, ProgressEvent, decode_message, encode_message
from producers.simulator import (
    EPOCH_US,
    SCENARIOS,
    BenignSpec,
    FaultSpec,
    SimConfig,
    SimConfigError,
    Simulation,
    ground_truth,
    simulate,
    validate,
    write_trace,
)
from producers.traces import iter_events

SCHEMA = json.loads(
    (Path(__file__).parents[2] / "producers/contracts/collective-event.schema.json").read_text()
)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

pytestmark = pytest.mark.timeout(60)


def us(seconds: float) -> int:
    return EPOCH_US + int(seconds * 1e6)


@cache
def events_of(name: str, **kw: object) -> tuple:
    """Events of a scenario, shortened/changed by ``kw``, cached across tests."""
    cfg = msgspec.structs.replace(SCENARIOS[name], **kw)
    return tuple(e for batch in simulate(cfg) for e in batch)


def ops(events, comm_prefix: str = "") -> list[OpEvent]:
    return [e for e in events if isinstance(e, OpEvent) and e.comm_name.startswith(comm_prefix)]


def progress(events, comm_prefix: str = "") -> list[ProgressEvent]:
    return [
        e for e in events if isinstance(e, ProgressEvent) and e.comm_name.startswith(comm_prefix)
    ]


# ------------------------------------------------------------------ contract ------


def test_deterministic_for_a_seed() -> None:
    cfg = msgspec.structs.replace(SCENARIOS["demo"], duration_s=12, seed=7)
    a = [encode_message(b) for b in simulate(cfg)]
    b = [encode_message(b) for b in simulate(cfg)]
    c = [encode_message(b) for b in simulate(msgspec.structs.replace(cfg, seed=8))]
    assert a == b
    assert a != c


def test_events_validate_against_schema_and_decode() -> None:
    cfg = SimConfig(hosts=4, pp=2, duration_s=4, faults=[], benign=[])
    batches = list(simulate(cfg))
    rng = np.random.default_rng(0)
    sample = [batches[i] for i in rng.choice(len(batches), size=60, replace=False)]
    kinds = set()
    for batch in sample + batches[-3:]:
        raw = encode_message(batch)
        VALIDATOR.validate(json.loads(raw))
        assert decode_message(raw) == batch
        kinds |= {(type(e).__name__, e.comm_name.split("-")[0]) for e in batch}
    assert ("OpEvent", "dp") in kinds and ("ProgressEvent", "tp") in kinds


def test_batches_are_one_host_one_comm_in_second_order() -> None:
    sim = Simulation(SimConfig(hosts=4, duration_s=6, clock_skew_ms=3))
    prev = -1
    per_second: dict[int, set] = defaultdict(set)
    for batch in sim.batches():
        second = sim.emitted_seconds - 1
        assert second >= prev
        prev = second
        assert len({(e.host, e.comm) for e in batch}) == 1
        key = (batch[0].host, batch[0].comm)
        assert key not in per_second[second], "one batch per host, communicator and second"
        per_second[second].add(key)
        for e in batch:
            assert us(second) - 5000 <= e.ts_us < us(second + 1) + 5000
    assert sorted(per_second) == list(range(6))
    assert all(len(keys) == 4 * (1 + 8) for keys in per_second.values())


def test_heartbeat_every_second_per_rank_per_comm() -> None:
    evs = events_of("healthy", duration_s=10)
    count: dict[tuple, list[int]] = defaultdict(list)
    for e in progress(evs):
        count[(e.comm, e.rank)].append((e.ts_us - EPOCH_US) // 1_000_000)
    # 16 TP comms x 8 ranks + 8 DP rings x 16 ranks
    assert len(count) == 16 * 8 + 8 * 16
    for seconds in count.values():
        assert len(seconds) == 10
        gaps = np.diff(sorted(seconds))
        assert gaps.max() <= 2


def test_seq_and_bytes_agree_across_ranks_and_counters_advance() -> None:
    evs = events_of("healthy", duration_s=10)
    by_key: dict[tuple, list[OpEvent]] = defaultdict(list)
    for e in ops(evs):
        by_key[(e.comm, e.seq)].append(e)
    complete = [v for v in by_key.values() if len(v) == v[0].nranks]
    assert len(complete) > 0.9 * len(by_key)
    for v in complete:
        assert len({e.bytes for e in v}) == 1
        assert sorted(e.rank for e in v) == list(range(v[0].nranks))
    dp = [e for e in ops(evs, "dp") if e.conns]
    e = dp[0]
    assert {c.dir for c in e.conns} == {"send", "recv"}
    assert all(c.bytes == 2 * 15 * (256 << 20) // 16 and c.retrans == 0 for c in e.conns)
    last = max(progress(evs, "dp"), key=lambda e: e.ts_us)
    assert last.started >= 20 and last.started - last.completed in (0, 1)


# ------------------------------------------------------------------ ring model ----


def exec_by_seq(evs, comm_name: str, after_us: int) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for e in ops(evs, comm_name):
        if e.comm_name == comm_name and e.ts_us > after_us:
            out[e.seq][e.host] = e.exec_us
    return {s: v for s, v in out.items() if len(v) == 16}


def test_straggler_has_the_shortest_kernel_time_and_peers_wait() -> None:
    evs = events_of("straggler", duration_s=40)
    before = exec_by_seq(evs, "dp-rail3", us(2))
    after = exec_by_seq(evs, "dp-rail3", us(21))
    before = {s: v for s, v in before.items() if max(v.values()) and s < min(after)}
    assert len(after) > 20
    shortest = [min(v, key=v.get) for v in after.values()]
    assert shortest.count("node-005") / len(shortest) > 0.9
    peers_after = np.median([x for v in after.values() for h, x in v.items() if h != "node-005"])
    peers_before = np.median([x for v in before.values() for x in v.values()])
    assert peers_after > 2 * peers_before
    # The straggler's TP peers wait for it, so its whole host is late to the first
    # gradient bucket on every rail; only its own rail sees it late every time.
    other = exec_by_seq(evs, "dp-rail0", us(21))
    share = [min(v, key=v.get) for v in other.values()].count("node-005") / len(other)
    assert 0.3 < share < 0.7
    # inside the host, the TP communicator names the GPU
    tp: dict[int, dict[int, float]] = defaultdict(dict)
    for e in ops(evs, "tp-node-005"):
        if e.ts_us > us(21):
            tp[e.seq][e.gpu] = e.exec_us
    assert all(min(v, key=v.get) == 3 for v in tp.values() if len(v) == 8)


def test_ring_model_last_arrival_plus_slowest_link() -> None:
    """The last rank to arrive waits for nothing: its kernel time is exactly the
    transfer time, 2(n-1)/n * bytes over the slowest link of the ring."""
    evs = events_of("slow_link", duration_s=30)
    by_op: dict[tuple, list[OpEvent]] = defaultdict(list)
    for e in ops(evs, "dp-rail"):
        by_op[(e.comm, e.seq)].append(e)
    checked = 0
    for group in by_op.values():
        if len(group) < 16:
            continue
        slowest = max(c.time_us for e in group for c in e.conns if c.dir == "send")
        assert min(e.exec_us for e in group) == pytest.approx(slowest, abs=0.2)
        nominal = 2 * 15 / 16 * (256 << 20) / 25e9 * 1e6
        assert slowest >= nominal
        checked += 1
    assert checked > 300


def test_config_from_toml(tmp_path: Path) -> None:
    from producers.simulator import load_config

    path = tmp_path / "job.toml"
    path.write_text(
        'job = "toml-job"\nhosts = 4\nduration_s = 3\n'
        '[[faults]]\nkind = "slow_nic"\nhost = 1\nnic = 2\nstart_s = 1\nseverity = 0.5\n'
        '[[benign]]\nkind = "clock_offset"\nhost = 0\nseverity = 2\n'
    )
    cfg = load_config(path)
    assert cfg.hosts == 4 and cfg.faults[0].nic == 2 and cfg.benign[0].kind == "clock_offset"
    assert {e.job for b in simulate(cfg) for e in b} == {"toml-job"}
    path.write_text("hosts = 4\nbogus = 1\n")
    with pytest.raises(SimConfigError, match="bogus"):
        load_config(path)


def conn_matrix(evs, comm_name: str, lo_us: int, hi_us: int) -> dict[tuple[str, str], float]:
    """Median send time per (src host, dst host) over a window."""
    hosts: dict[int, str] = {}
    cells: dict[tuple[int, int], list[float]] = defaultdict(list)
    for e in ops(evs, comm_name):
        if e.comm_name != comm_name or not lo_us <= e.ts_us < hi_us:
            continue
        hosts[e.rank] = e.host
        for c in e.conns:
            if c.dir == "send":
                cells[(e.rank, c.peer)].append(c.time_us)
    return {(hosts[s], hosts[d]): float(np.median(v)) for (s, d), v in cells.items()}


def slow_cells(matrix: dict[tuple[str, str], float]) -> set[tuple[str, str]]:
    med = np.median(list(matrix.values()))
    return {k for k, v in matrix.items() if v > 1.5 * med}


def test_slow_nic_is_a_slow_row_and_column() -> None:
    evs = events_of("slow_nic", duration_s=40)
    assert not slow_cells(conn_matrix(evs, "dp-rail2", us(1), us(19)))
    after = slow_cells(conn_matrix(evs, "dp-rail2", us(21), us(40)))
    assert after == {("node-009", "node-010"), ("node-008", "node-009")}
    assert not slow_cells(conn_matrix(evs, "dp-rail3", us(21), us(40)))


def test_slow_link_is_a_single_cell() -> None:
    evs = events_of("slow_link", duration_s=40)
    after = slow_cells(conn_matrix(evs, "dp-rail6", us(21), us(40)))
    assert after == {("node-003", "node-004")}


def test_congestion_slows_every_link_and_marks_no_cell() -> None:
    evs = events_of("benign_mix", duration_s=42)
    before = conn_matrix(evs, "dp-rail1", us(22), us(29))
    during = conn_matrix(evs, "dp-rail1", us(31), us(39))
    assert not slow_cells(during)
    ratio = np.median(list(during.values())) / np.median(list(before.values()))
    assert 1.8 < ratio < 2.2


# ------------------------------------------------------------------ hangs ---------


def test_host_down_goes_silent_and_peers_wait() -> None:
    evs = events_of("host_down", duration_s=40, clock_skew_ms=0)
    assert not [e for e in evs if e.host == "node-011" and e.ts_us >= us(30)]
    assert [e for e in evs if e.host == "node-011" and e.ts_us >= us(29)]
    late = [e for e in progress(evs, "dp") if e.ts_us > us(38)]
    assert late and all(e.started == e.completed + 1 for e in late)
    assert all(e.inflight_us > 6e6 for e in late)
    assert not [e for e in ops(evs) if e.ts_us > us(32)]


def test_rank_hang_freezes_its_counters_while_peers_wait() -> None:
    evs = events_of("rank_hang", duration_s=40)
    tp = [e for e in progress(evs, "tp-node-007") if e.ts_us > us(32)]
    hung = [e for e in tp if e.rank == 1]
    peers = [e for e in tp if e.rank != 1]
    assert len(hung) >= 7, "the live host's exporter keeps reporting the hung rank"
    assert len({(e.started, e.completed) for e in hung}) == 1
    assert hung[0].started == hung[0].completed and hung[0].inflight_op is None
    assert all(e.started == hung[0].started + 1 and e.completed == hung[0].completed for e in peers)
    peer0 = sorted((e for e in peers if e.rank == 0), key=lambda e: e.ts_us)
    assert np.all(np.diff([e.inflight_us for e in peer0]) > 0.9e6)


def test_link_hang_retransmits_and_nobody_completes() -> None:
    evs = events_of("link_hang", duration_s=40)
    ring = [e for e in progress(evs, "dp-rail5") if e.ts_us > us(32)]
    assert ring and all(e.started == e.completed + 1 for e in ring)
    sender = sorted((e for e in ring if e.host == "node-002"), key=lambda e: e.ts_us)
    retrans = [next(c.retrans for c in e.conns if c.dir == "send") for e in sender]
    assert len(retrans) >= 6 and np.all(np.diff(retrans) > 0)
    stalled = {next(c.bytes for c in e.conns if c.dir == "send") for e in sender}
    assert len(stalled) == 1, "the stalled connection's bytes stop growing"
    total = 2 * 15 * (256 << 20) // 16
    other = [e for e in ring if e.host not in ("node-002", "node-003")]
    assert all(c.bytes == total for e in other for c in e.conns)
    receiver = [e for e in ring if e.host == "node-003"]
    assert {next(c.bytes for c in e.conns if c.dir == "recv") for e in receiver} == stalled
    assert not [e for e in ops(evs) if e.ts_us > us(33)]


# ------------------------------------------------------------------ benign --------


def test_checkpoint_pauses_everyone_together() -> None:
    evs = events_of("benign_mix", duration_s=25)
    during = [e for e in ops(evs) if us(15.2) < e.ts_us < us(19.9)]
    assert not during, "no collective completes while the job checkpoints"
    beats = [e for e in progress(evs) if us(16) <= e.ts_us < us(19.9)]
    assert len(beats) >= 3 * 256
    counters: dict[tuple, set] = defaultdict(set)
    for e in beats:
        counters[(e.comm, e.rank)].add((e.started, e.completed))
    assert all(len(v) == 1 for v in counters.values()), "everybody paused at once"
    assert [e for e in ops(evs) if us(20) <= e.ts_us < us(21)]


def test_blip_slows_one_step_on_one_gpu() -> None:
    evs = events_of("benign_mix", duration_s=50)
    runs = exec_by_seq(evs, "dp-rail2", us(44))
    late = [s for s, v in runs.items() if min(v, key=v.get) == "node-004"]
    peers = {s: np.median([x for h, x in v.items() if h != "node-004"]) for s, v in runs.items()}
    slow = [s for s in runs if peers[s] > 5 * np.median(list(peers.values()))]
    assert 1 <= len(slow) <= 2 and set(slow) <= set(late)


def test_clock_offset_shifts_one_host() -> None:
    base = events_of("benign_mix", duration_s=3)
    cfg = msgspec.structs.replace(SCENARIOS["benign_mix"], duration_s=3)
    skewed = msgspec.structs.replace(
        cfg, benign=[*cfg.benign[:3], BenignSpec(kind="clock_offset", host=6, severity=9.0)]
    )
    other = tuple(e for b in simulate(skewed) for e in b)
    shift = {b.ts_us - a.ts_us for a, b in zip(base, other, strict=True) if a.host == "node-006"}
    assert shift == {5000}
    assert all(a.ts_us == b.ts_us for a, b in zip(base, other, strict=True) if a.host != "node-006")


# ------------------------------------------------------------------ pipeline ------


def test_pipeline_send_recv_pairs() -> None:
    cfg = SimConfig(hosts=4, pp=2, duration_s=5)
    evs = [e for b in simulate(cfg) for e in b]
    pp = ops(evs, "pp-")
    assert {e.op for e in pp} == {"Send", "Recv"}
    pairs: dict[tuple, set] = defaultdict(set)
    for e in pp:
        pairs[(e.comm, e.seq)].add((e.rank, e.op))
        assert e.nranks == 2 and len(e.conns) == 1 and e.conns[0].peer == 1 - e.rank
    full = [v for v in pairs.values() if len(v) == 2]
    assert {frozenset(v) for v in full} == {
        frozenset({(0, "Send"), (1, "Recv")}),
        frozenset({(0, "Recv"), (1, "Send")}),
    }
    assert {e.comm_name for e in ops(evs, "dp")} == {
        f"dp-s{s}-rail{r}" for s in (0, 1) for r in range(8)
    }


# ------------------------------------------------------------------ truth, files --


def test_ground_truth_matches_injected_faults() -> None:
    faults = [
        FaultSpec(kind="straggler", host=1, gpu=2, start_s=5, end_s=9, severity=1.2),
        FaultSpec(kind="slow_nic", host=2, nic=3, start_s=6, severity=0.5),
        FaultSpec(kind="slow_link", host=3, nic=4, peer_host=0, start_s=7, severity=0.4),
        FaultSpec(kind="rank_hang", host=0, gpu=7, start_s=20),
        FaultSpec(kind="host_down", host=1, start_s=21),
        FaultSpec(kind="link_hang", host=2, peer_host=3, nic=1, start_s=22),
    ]
    benign = [BenignSpec(kind="checkpoint", start_s=3, duration_s=2)]
    gt = ground_truth(SimConfig(hosts=4, faults=faults, benign=benign, seed=3))
    got = [(f.expected_fault, f.host, f.gpu, f.nic, f.peer_host, f.start_us) for f in gt.faults]
    assert got == [
        ("straggler", "node-001", 2, None, None, us(5)),
        ("slow_nic", "node-002", None, "mlx5_3", None, us(6)),
        ("slow_link", "node-003", None, "mlx5_4", "node-000", us(7)),
        ("noncomm_hang", "node-000", 7, None, None, us(20)),
        ("noncomm_hang", "node-001", None, None, None, us(21)),
        ("comm_hang", "node-002", None, "mlx5_1", "node-003", us(22)),
    ]
    assert gt.faults[0].end_us == us(9) and gt.gpus == 32 and gt.seed == 3
    assert len({f.id for f in gt.faults}) == 6
    assert gt.benign[0].kind == "checkpoint" and gt.benign[0].end_us == us(5)


def test_write_trace_round_trips(tmp_path: Path) -> None:
    cfg = msgspec.structs.replace(SCENARIOS["straggler"], duration_s=3)
    stats = write_trace(cfg, tmp_path / "t.jsonl.gz", tmp_path / "truth.json")
    evs = list(iter_events(tmp_path / "t.jsonl.gz"))
    assert stats.events == len(evs) == len(events_of("straggler", duration_s=3))
    truth = json.loads((tmp_path / "truth.json").read_text())
    assert truth["faults"][0]["host"] == "node-005" and truth["gpus"] == 128
    assert set(truth) >= {"job", "seed", "hosts", "gpus", "faults", "benign"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(tp=3), "tp=3 must divide"),
        (dict(pp=16), "at least 2 hosts"),
        (
            dict(
                faults=[
                    FaultSpec(kind="slow_link", host=1, nic=0, peer_host=5, start_s=1, severity=0.5)
                ]
            ),
            "no traffic",
        ),
        (dict(faults=[FaultSpec(kind="slow_nic", host=1, nic=9, start_s=1)]), "nic (rail) 9"),
        (
            dict(faults=[FaultSpec(kind="straggler", host=1, gpu=0, start_s=1, severity=0.5)]),
            ">= 1",
        ),
    ],
)
def test_bad_configs_say_what_to_fix(change: dict, message: str) -> None:
    with pytest.raises(SimConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(msgspec.structs.replace(SimConfig(), **change))


def test_cli_simulate_writes_trace_and_truth(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from c4stream.cli import app

    out, truth = tmp_path / "t.jsonl", tmp_path / "truth.json"
    args = ["simulate", "--scenario", "host_down", "--gpus", "128", "--duration", "2"]
    args += ["--seed", "3", "--out", str(out), "--truth", str(truth), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "events" in result.output
    assert json.loads(truth.read_text())["seed"] == 3
    assert sum(1 for _ in iter_events(out)) > 1000
    bad = CliRunner().invoke(app, ["simulate", "--scenario", "nope", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown scenario" in bad.output
