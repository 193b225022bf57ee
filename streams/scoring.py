"""Scoring of detector decisions against the simulator's ground truth, written once.

The one scorer of the tests, the quality benchmark and the demo's "found" count.
Every detector of the quality benchmark — c4stream's :class:`IsolationCommand` stream
and the two baselines — is reduced to a list of :class:`Decision`; every injected
fault of a run's ground truth to a :class:`TruthFault`. :func:`score_run` pairs them.

**The matching rule.** A decision *matches* a fault when all of these hold:

1. time — ``decision.ts_us >= fault.start_us - slack_us`` (1 s of slack: hosts' clocks
   are only millisecond-synchronized and a fault may start mid-heartbeat);
2. host — ``decision.host == fault.host``; for the two link faults (``slow_link``,
   ``comm_hang`` from a link hang) either end of the link is accepted, i.e. the
   fault's ``host`` (sender) or its ``peer_host`` (receiver). Why: a one-way link
   fault shows at both ends (the sender's sends and the receiver's receives are both
   slow) and cordoning either end takes the link out of the job, so naming the
   receiver is a correct localization, not a false isolation;
3. class — ``decision.fault == fault.expected_fault``. Straggler and non-communication
   hang are the same syndrome seen at two severities (a rank arriving late vs. never),
   so a right-host decision with the other of those two classes is scored *found,
   wrong class*: it counts neither as recall nor as a false isolation.

A decision that names no host (the watchdog's "job hung", the NCCL-RAS rule's "stuck
collective, nobody behind") *detects* a hang fault that started before it — it is
``unlocalized``: counted in the *detected* column, never in *localized*.

The *component* is the GPU (straggler, rank hang), the NIC (slow NIC, link hang), or
the NIC plus the other end of the link (slow link); a host-down fault has none.
*Localized* (and *component*) count only isolating decisions: a right-host
``alert_only`` command (e.g. held back by the policy's cap) is counted as *detected*,
so recall cannot be bought with alerts that cost nothing in false isolations.
Detection latency is ``ts_us`` of the first localizing decision minus ``start_us``; a
detector that never localizes gets the latency of its first detection.

A *false isolation* is an isolating decision (any action but ``alert_only``) that
matches no fault, not even as wrong class or unlocalized.

>>> f = TruthFault(id="f0", kind="straggler", expected_fault="straggler", host="node-003",
...                gpu=2, start_us=10_000_000)
>>> d = Decision(detector="x", ts_us=14_000_000, host="node-003", fault="straggler",
...              action="cordon", gpu=2)
>>> outcome(d, f), component_ok(d, f)
('match', True)
>>> outcome(msgspec.structs.replace(d, fault="noncomm_hang"), f)
'wrong_class'
>>> outcome(msgspec.structs.replace(d, ts_us=8_000_000), f) is None   # before the fault
True
>>> s = score_run([d], [f])
>>> s.faults[0].localized, s.faults[0].latency_us, s.false_isolations
(True, 4000000, 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec

from streams.commands import IsolationCommand

__all__ = [
    "CONFUSABLE",
    "HANG_FAULTS",
    "LINK_FAULTS",
    "Decision",
    "FaultScore",
    "Outcome",
    "RunScore",
    "TruthFault",
    "component_label",
    "component_ok",
    "from_command",
    "outcome",
    "score_commands",
    "score_run",
    "truth_faults",
]

SLACK_US = 1_000_000
"""Decisions up to this long before a fault's start still match it (clock skew)."""

HANG_FAULTS = frozenset({"noncomm_hang", "comm_hang"})
LINK_FAULTS = frozenset({"slow_link", "comm_hang"})
CONFUSABLE = frozenset({frozenset({"straggler", "noncomm_hang"})})
"""Pairs of classes scored as "found, wrong class" rather than as a false isolation."""

Outcome = Literal["match", "wrong_class", "unlocalized"]


class Decision(msgspec.Struct, kw_only=True, frozen=True):
    """One conclusion of one detector, in a form common to c4stream and the baselines."""

    detector: str
    ts_us: int
    """Event time of the decision."""
    host: str | None
    """The host blamed; ``None`` for a job-level alarm that names no host."""
    fault: str | None
    """Fault class claimed; ``None`` for "a hang somewhere" (the watchdog)."""
    action: str
    """``alert_only`` reports without isolating; anything else isolates (or kills the job)."""
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    reason: str = ""

    @property
    def isolating(self) -> bool:
        return self.action != "alert_only"


class TruthFault(msgspec.Struct, kw_only=True, frozen=True):
    """One injected fault, as the simulator's ground-truth JSON describes it."""

    id: str
    kind: str
    expected_fault: str
    host: str
    start_us: int
    gpu: int | None = None
    nic: str | None = None
    peer_host: str | None = None
    end_us: int | None = None
    severity: float | None = None


class FaultScore(msgspec.Struct, kw_only=True):
    """How one detector did on one injected fault."""

    fault_id: str
    detected: bool
    """Some decision matched, localized or not (or with the confusable class)."""
    localized: bool
    """An isolating decision matched on host, class and time."""
    component: bool | None
    """A matching decision also named the right GPU / NIC / link; None when the fault has none."""
    wrong_class: bool
    """Found on the right host, but only with the confusable class."""
    latency_us: int | None
    """First localizing match (else first detection) minus the fault's start."""

    @property
    def found(self) -> bool:
        """Taken out on the right host with the right class, naming the right component."""
        return self.localized and self.component is not False

    @property
    def latency_s(self) -> float | None:
        return None if self.latency_us is None else round(self.latency_us / 1e6, 1)


class RunScore(msgspec.Struct, kw_only=True):
    """How one detector did on one run (trace)."""

    faults: list[FaultScore]
    false_isolations: int
    false_hosts: int
    """Distinct hosts among the false isolations (cordons are per host)."""
    decisions: int
    isolating: int
    false_decisions: list[Decision] = []
    """The false isolations themselves, for messages."""

    @property
    def all_found(self) -> bool:
        return all(f.found for f in self.faults)


def truth_faults(truth: Any) -> list[TruthFault]:
    """The faults of a ground truth, given as the simulator's struct or its JSON dict.

    >>> truth_faults({"faults": [{"id": "a", "kind": "host_down", "host": "node-001",
    ...     "expected_fault": "noncomm_hang", "start_us": 5}]})[0].expected_fault
    'noncomm_hang'
    """
    data = truth if isinstance(truth, dict) else msgspec.to_builtins(truth)
    return [msgspec.convert(f, TruthFault) for f in data.get("faults", [])]


def from_command(cmd: IsolationCommand, detector: str = "c4stream") -> Decision:
    """A c4stream isolation command as a :class:`Decision`."""
    return Decision(
        detector=detector,
        ts_us=cmd.ts_us,
        host=cmd.host,
        fault=cmd.fault,
        action=cmd.action,
        gpu=cmd.gpu,
        nic=cmd.nic,
        peer_host=cmd.peer_host,
        reason=cmd.reason,
    )


def _ends(f: TruthFault) -> set[str]:
    ends = {f.host}
    if f.expected_fault in LINK_FAULTS and f.peer_host is not None:
        ends.add(f.peer_host)
    return ends


def outcome(d: Decision, f: TruthFault, slack_us: int = SLACK_US) -> Outcome | None:
    """How decision ``d`` relates to fault ``f`` under the matching rule (None: not at all)."""
    if d.ts_us < f.start_us - slack_us:
        return None
    if d.host is None:
        claimed_hang = d.fault is None or d.fault in HANG_FAULTS
        return "unlocalized" if claimed_hang and f.expected_fault in HANG_FAULTS else None
    if d.host not in _ends(f):
        return None
    if d.fault == f.expected_fault:
        return "match"
    if frozenset({d.fault, f.expected_fault}) in CONFUSABLE:
        return "wrong_class"
    return None


def component_ok(d: Decision, f: TruthFault) -> bool | None:
    """Whether a matching decision names the faulty component (None: the fault has none).

    >>> f = TruthFault(id="l", kind="slow_link", expected_fault="slow_link", host="a",
    ...                peer_host="b", nic="mlx5_3", start_us=0)
    >>> d = Decision(detector="x", ts_us=1, host="b", fault="slow_link", action="cordon",
    ...              nic="mlx5_3", peer_host="a")
    >>> component_ok(d, f), component_ok(msgspec.structs.replace(d, peer_host="c"), f)
    (True, False)
    """
    if f.gpu is not None:
        return d.gpu == f.gpu
    if f.nic is None:
        return None
    if d.nic != f.nic:
        return False
    if f.expected_fault == "slow_link":
        # The link is the (unordered) pair of its ends; the detector names one end as
        # host and must name the other as peer_host.
        return d.peer_host is not None and {d.host, d.peer_host} == _ends(f)
    return True


def score_fault(
    decisions: Sequence[Decision], f: TruthFault, slack_us: int = SLACK_US
) -> FaultScore:
    """Score one fault against all decisions of one detector on its run."""
    first_match: int | None = None
    first_unloc: int | None = None
    wrong = False
    comp: bool | None = None if component_ok(_probe(f), f) is None else False
    for d in decisions:
        o = outcome(d, f, slack_us)
        if o == "match" and not d.isolating:
            o = "unlocalized"  # named but not taken out (alert_only): detected only
        if o == "match":
            first_match = d.ts_us if first_match is None else min(first_match, d.ts_us)
            if component_ok(d, f):
                comp = True
        elif o == "unlocalized":
            first_unloc = d.ts_us if first_unloc is None else min(first_unloc, d.ts_us)
        elif o == "wrong_class":
            wrong = True
    first = first_match if first_match is not None else first_unloc
    return FaultScore(
        fault_id=f.id,
        detected=first is not None or wrong,
        localized=first_match is not None,
        component=comp,
        wrong_class=wrong and first_match is None,
        latency_us=None if first is None else max(0, first - f.start_us),
    )


def _probe(f: TruthFault) -> Decision:
    # A decision with no component at all: component_ok(...) is None only when the
    # fault itself has no component.
    return Decision(detector="", ts_us=0, host=f.host, fault=f.expected_fault, action="")


def score_run(
    decisions: Iterable[Decision], faults: Sequence[TruthFault], slack_us: int = SLACK_US
) -> RunScore:
    """Score one detector's decisions on one run against that run's injected faults."""
    ds = list(decisions)
    false = [d for d in ds if d.isolating and all(outcome(d, f, slack_us) is None for f in faults)]
    return RunScore(
        faults=[score_fault(ds, f, slack_us) for f in faults],
        false_isolations=len(false),
        false_hosts=len({d.host for d in false}),
        decisions=len(ds),
        isolating=sum(d.isolating for d in ds),
        false_decisions=false,
    )


def score_commands(
    commands: Iterable[IsolationCommand], truth: Any, slack_us: int = SLACK_US
) -> RunScore:
    """c4stream's commands against a ground truth (the simulator's struct or its JSON).

    >>> truth = {"faults": [{"id": "f0", "kind": "straggler", "expected_fault": "straggler",
    ...          "host": "node-005", "gpu": 3, "start_us": 0}]}
    >>> cmd = IsolationCommand(id="c", ts_us=12_000_000, job="j", host="node-005", gpu=3,
    ...                        fault="straggler", action="cordon", confidence=0.9, reason="r",
    ...                        evidence={})
    >>> r = score_commands([cmd], truth)
    >>> r.faults[0].found, r.faults[0].latency_s, r.false_isolations
    (True, 12.0, 0)
    """
    return score_run([from_command(c) for c in commands], truth_faults(truth), slack_us)


def component_label(
    gpu: int | None, nic: str | int | None, peer_host: str | None = None, fault: str | None = None
) -> str:
    """How a person names the component: ``GPU 5``, ``NIC mlx5_1``, ``link to node-002``.

    A NIC or link fault names the NIC even when the command also carries the GPU of the
    rank that saw it:

    >>> component_label(1, "mlx5_1", fault="slow_nic"), component_label(1, "mlx5_1")
    ('NIC mlx5_1', 'GPU 1')

    >>> component_label(5, None), component_label(None, "mlx5_1"), component_label(None, 1)
    ('GPU 5', 'NIC mlx5_1', 'NIC mlx5_1')
    >>> component_label(None, "mlx5_3", "node-002"), component_label(None, None)
    ('NIC mlx5_3 → node-002', 'host')
    """
    if gpu is not None and not (fault == "slow_nic" or fault in LINK_FAULTS):
        return f"GPU {gpu}"
    if nic is not None:
        # The simulator's ground truth numbers NICs; commands name the device.
        name = f"mlx5_{nic}" if isinstance(nic, int) else nic
        return f"NIC {name}" + (f" → {peer_host}" if peer_host else "")
    return f"link to {peer_host}" if peer_host else "host"
