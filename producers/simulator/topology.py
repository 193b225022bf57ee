"""Who talks to whom: hosts, GPUs, and the communicators of a 3-D parallel job.

Global rank ``r = host * gpus_per_host + gpu``. Communicators come in *families*: all
communicators of a family run the same op sequence (same count, sizes, seq numbers),
so the simulator times a whole family with one numpy operation over a
``(groups, members)`` matrix of global ranks.

- ``tp``: one group per ``tp`` consecutive GPUs of a host (NVLink, no NIC).
- ``dp``: one ring per (pipeline stage, rail): GPU ``r`` of every host of the stage,
  in host order, sending through NIC ``mlx5_r``. Member ``i`` sends to ``i+1``.
- ``pp<b>``: one two-rank communicator per (boundary b, host index, rail) between
  stage ``b`` and ``b+1`` (member 0 in stage b).

>>> from producers.simulator.config import SimConfig
>>> topo = Topology.build(SimConfig(hosts=4, gpus_per_host=2, tp=2, pp=2))
>>> [(f.name, f.members.shape) for f in topo.families]
[('tp', (4, 2)), ('dp', (4, 2)), ('pp0', (4, 2))]
>>> topo.comm_names[:3], topo.comm_names[4:6], topo.comm_names[-1]
(['tp-node-000', 'tp-node-001', 'tp-node-002'], ['dp-s0-rail0', 'dp-s0-rail1'], 'pp-s0-node-001-g1')
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from producers.simulator.config import SimConfig

__all__ = ["Family", "Topology", "comm_id", "host_name"]


def host_name(host: int, width: int = 3) -> str:
    """Wire name of a host: ``node-007``."""
    return f"node-{host:0{width}d}"


def comm_id(job: str, name: str) -> str:
    """A stable communicator id in NCCL's 0x-hex style, derived from job and name.

    >>> comm_id("j", "dp-rail0") == comm_id("j", "dp-rail0")
    True
    """
    return "0x" + hashlib.blake2b(f"{job}/{name}".encode(), digest_size=8).hexdigest()


@dataclass
class Family:
    """Communicators that share one op sequence, as a (groups, members) rank matrix."""

    name: str  # "tp", "dp", "pp0", ... (pipelined shapes: "tp-s0", "dp-s0", "ep-s0", "pp0")
    kind: str  # "tp", "dp", "pp" or "ep"
    members: np.ndarray  # (g, n) int global ranks
    comms: np.ndarray  # (g,) int index into Topology.comm_* lists
    network: bool  # whether its traffic crosses NICs (then events carry conns and nic)
    stage: int = -1  # pipelined shapes: the stage of a tp/dp/ep family

    @property
    def groups(self) -> int:
        return self.members.shape[0]

    @property
    def size(self) -> int:
        return self.members.shape[1]


@dataclass
class Topology:
    """Hosts, ranks and communicators of one job."""

    hosts: int
    gpus_per_host: int
    host_names: list[str]
    families: list[Family]
    comm_names: list[str] = field(default_factory=list)
    comm_ids: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.hosts * self.gpus_per_host

    def host_of(self, ranks: np.ndarray) -> np.ndarray:
        return ranks // self.gpus_per_host

    def gpu_of(self, ranks: np.ndarray) -> np.ndarray:
        return ranks % self.gpus_per_host

    def family(self, name: str) -> Family | None:
        for fam in self.families:
            if fam.name == name:
                return fam
        return None

    @classmethod
    def build(cls, cfg: SimConfig) -> Topology:
        H, G, T, P = cfg.hosts, cfg.gpus_per_host, cfg.tp, cfg.pp
        hps = H // P
        width = max(3, len(str(H - 1)))
        names = [host_name(h, width) for h in range(H)]
        topo = cls(hosts=H, gpus_per_host=G, host_names=names, families=[])

        def add(
            name: str, kind: str, members: np.ndarray, labels: list[str], net: bool, stage: int = -1
        ) -> None:
            start = len(topo.comm_names)
            topo.comm_names.extend(labels)
            topo.comm_ids.extend(comm_id(cfg.job, lab) for lab in labels)
            comms = np.arange(start, start + len(labels))
            topo.families.append(Family(name, kind, members.astype(np.int64), comms, net, stage))

        if cfg.pipelined:
            topo._build_staged(cfg, names, add)
            return topo

        ranks = np.arange(H * G).reshape(H, G)
        if T > 1:
            per_host = G // T
            members = ranks.reshape(H * per_host, T)
            labels = [
                f"tp-{names[h]}" if per_host == 1 else f"tp-{names[h]}-{k}"
                for h in range(H)
                for k in range(per_host)
            ]
            add("tp", "tp", members, labels, False)
        # DP rings: stage s, rail r -> GPU r of hosts s*hps .. s*hps+hps-1
        staged = ranks.reshape(P, hps, G)
        members = staged.transpose(0, 2, 1).reshape(P * G, hps)
        labels = [
            f"dp-rail{r}" if P == 1 else f"dp-s{s}-rail{r}" for s in range(P) for r in range(G)
        ]
        add("dp", "dp", members, labels, True)
        for b in range(P - 1):
            a = staged[b].reshape(-1)
            c = staged[b + 1].reshape(-1)
            members = np.stack([a, c], axis=1)
            labels = [f"pp-s{b}-{names[int(x) // G]}-g{int(x) % G}" for x in a]
            add(f"pp{b}", "pp", members, labels, True)
        return topo

    def _build_staged(self, cfg: SimConfig, names: list[str], add) -> None:  # noqa: ANN001
        """Families of the microbatched shapes: one per stage for tp/dp/ep (stages run
        their collectives at different times), one per pipeline boundary for pp.

        Communicator names are those of the classic shape (``tp-node-XXX``,
        ``dp-s<s>-rail<r>``, ``pp-s<b>-node-XXX-g<r>``) plus ``ep-s<s>-rail<r>-<k>`` for
        expert groups. An interleaved pipeline also has the wrap boundary ``pp<P-1>``
        from the last stage (member 0) to the first: chunk c+1 starts on stage 0.
        """
        H, G, T, P = cfg.hosts, cfg.gpus_per_host, cfg.tp, cfg.pp
        hps = H // P
        staged = np.arange(H * G).reshape(P, hps, G)
        for s in range(P):
            hosts = range(s * hps, (s + 1) * hps)
            if T > 1:
                per_host = G // T
                labels = [
                    f"tp-{names[h]}" if per_host == 1 else f"tp-{names[h]}-{k}"
                    for h in hosts
                    for k in range(per_host)
                ]
                add(f"tp-s{s}", "tp", staged[s].reshape(hps * per_host, T), labels, False, s)
            rings = staged[s].T  # (G, hps): GPU r of every host of the stage
            labels = [f"dp-rail{r}" if P == 1 else f"dp-s{s}-rail{r}" for r in range(G)]
            add(f"dp-s{s}", "dp", rings, labels, True, s)
            if cfg.moe_every:
                blocks = hps // cfg.ep
                members = rings.reshape(G * blocks, cfg.ep)
                labels = [f"ep-s{s}-rail{r}-{k}" for r in range(G) for k in range(blocks)]
                add(f"ep-s{s}", "ep", members, labels, True, s)
        wrap = cfg.schedule == "interleaved" and P > 1
        for b in range(P if wrap else P - 1):
            a = staged[b].reshape(-1)
            c = staged[(b + 1) % P].reshape(-1)
            labels = [f"pp-s{b}-{names[int(x) // G]}-g{int(x) % G}" for x in a]
            add(f"pp{b}", "pp", np.stack([a, c], axis=1), labels, True)
