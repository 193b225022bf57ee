"""A real Kubernetes API server for tests: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler on 127.0.0.1, started once per pytest session (``kube_cluster`` fixture).

``tests/conftest.py`` registers this module as a plugin; tests that take the fixture
carry ``@pytest.mark.kubernetes``::

    def test_cordon(kube_cluster: KubeCluster) -> None:
        kube_cluster.kubectl("create", "-f", "node.yaml")

What it starts: ``tools/kube-apiserver/start.sh WORKDIR --with-controllers`` (certificates
made with openssl, free loopback ports; see that directory's README.md), with the
binaries ``tools/kube-apiserver/install.sh`` built and cached in ``~/.cache/c4stream-k8s/bin``
(``./run test`` runs it: a one-time build of 20-30 min, then cached). Then, as the
administrator, it applies the shipped manifests a user would apply: the RBAC files of
``compose/k8s/`` and the admission policy, so every test acts as the actuator's service
account (``system:serviceaccount:c4stream:c4stream-actuator``) through a token
kubeconfig (:attr:`KubeCluster.actuator_kubeconfig`) under the real RBAC and admission.

What a bare API server is not: there is no kubelet. Nodes are plain objects the tests
create (with a Ready status); pods stay ``Pending`` until a test patches their status;
a deleted pod bound to a node stays terminating until a test finishes it
(:meth:`KubeCluster.finish_pod`). The Job controller, the scheduler, the garbage
collector and the taint-eviction controllers do run.

When the binaries are missing (no Go, the build failed or was never run) every test that
takes the fixture skips and says so; without the two controllers' binaries the server
starts without them and the tests that need them skip (:meth:`KubeCluster.need_controllers`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["KubeCluster", "kube_cluster", "node_manifest"]

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools" / "kube-apiserver"
K8S = ROOT / "compose" / "k8s"
BINARIES = ("kube-apiserver", "etcd", "kubectl")
CONTROLLERS = ("kube-controller-manager", "kube-scheduler")
ACTUATOR_SA = ("c4stream", "c4stream-actuator")
_NOT_READY = "node.kubernetes.io/not-ready"
_UNREACHABLE = "node.kubernetes.io/unreachable"
_UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
#: The manifests applied at start, in order (a user's install: RBAC, then the policy).
MANIFESTS = (
    "rbac-actuator.yaml",
    "rbac-actuator-restart.yaml",
    "rbac-actuator-dra.yaml",
    "admission-actuator.yaml",
)


def bin_dir() -> Path:
    """Where install.sh caches the binaries (``C4K8S_BIN``, else ``C4K8S_CACHE``/bin)."""
    if os.environ.get("C4K8S_BIN"):
        return Path(os.environ["C4K8S_BIN"])
    cache = os.environ.get("C4K8S_CACHE") or str(Path.home() / ".cache" / "c4stream-k8s")
    return Path(cache) / "bin"


def wanted_version() -> str:
    return os.environ.get("K8S_VERSION") or (TOOLS / "VERSION").read_text().strip()


def node_manifest(name: str, **spec: Any) -> dict[str, Any]:
    """A Node as a kubelet would have registered it: Ready, with capacity and allocatable."""
    res = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": spec,
        "status": {
            "capacity": dict(res),
            "allocatable": dict(res),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
            ],
        },
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class KubeCluster:
    """A running test cluster (see the module docstring)."""

    workdir: Path
    kubeconfig: Path
    """The administrator's (``system:masters``)."""
    actuator_kubeconfig: Path
    """A token of the actuator's service account, with the shipped RBAC and policy."""
    version: str
    bin: Path
    controllers: bool
    """kube-controller-manager and kube-scheduler run (their binaries were built)."""

    def need_controllers(self) -> None:
        """Skip a test that needs the Job controller, the scheduler or the type checker."""
        if not self.controllers:
            pytest.skip(
                f"no {' / '.join(CONTROLLERS)} in {self.bin}: "
                "tools/kube-apiserver/install.sh --with-controllers builds them"
            )

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, as_actuator: bool = False
    ) -> subprocess.CompletedProcess[str]:
        conf = self.actuator_kubeconfig if as_actuator else self.kubeconfig
        proc = subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(conf), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def apply(self, obj: dict[str, Any] | str) -> None:
        """``kubectl apply`` a dict or YAML text, as the administrator."""
        text = obj if isinstance(obj, str) else json.dumps(obj)
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        out = self.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(obj))
        return dict(json.loads(out.stdout))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        ns = ["-n", namespace] if namespace else []
        return dict(json.loads(self.kubectl("get", kind, name, *ns, "-o", "json").stdout))

    def items(self, kind: str, *args: str) -> list[dict[str, Any]]:
        return list(json.loads(self.kubectl("get", kind, *args, "-o", "json").stdout)["items"])

    def add_node(self, name: str, **spec: Any) -> dict[str, Any]:
        """A Ready node (no kubelet: the object only), with ``spec`` (taints, …)."""
        self.create(node_manifest(name, **spec))
        # Written again as the kubelet would (with a fresh heartbeat).
        self.kubectl(
            "patch", "node", name, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": node_manifest(name)["status"]}),
        )  # fmt: skip

        # The TaintNodesByCondition admission plugin gives a new node the taint
        # node.kubernetes.io/not-ready; the node-lifecycle controller lifts it once it
        # sees Ready. Wait for that, so no controller changes the taints during the test.
        def settled() -> dict[str, Any] | None:
            node = self.get("node", name)
            keys = {t["key"] for t in node["spec"].get("taints") or []}
            return None if keys & {_NOT_READY, _UNREACHABLE} else node

        if not self.controllers:  # nobody would lift it: do it as the controller would
            self.kubectl("taint", "node", name, f"{_NOT_READY}:NoSchedule-", check=False)
        return dict(self.wait(f"node {name} without {_NOT_READY}", settled, timeout=60))

    def settle_cordon(self, name: str) -> None:
        """Wait until the node-lifecycle controller has mirrored a cordon as the taint
        node.kubernetes.io/unschedulable (when it runs), so the node stays as it is."""
        if not self.controllers:
            return

        def mirrored() -> bool:
            node = self.get("node", name)
            return any(t["key"] == _UNSCHEDULABLE for t in node["spec"].get("taints") or [])

        self.wait(f"node {name}'s {_UNSCHEDULABLE} taint", mirrored, timeout=60)

    def namespace(self, prefix: str = "t") -> str:
        """A fresh namespace with its ``default`` ServiceAccount."""
        ns = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.kubectl("create", "namespace", ns)
        if not self.controllers:  # the service-account controller would make it
            self.kubectl("create", "serviceaccount", "default", "-n", ns)
        deadline = time.monotonic() + 30
        while self.kubectl("get", "sa", "default", "-n", ns, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"no default ServiceAccount in {ns} after 30 s")
            time.sleep(0.2)
        return ns

    def set_pod_phase(self, ns: str, name: str, phase: str, **status: Any) -> None:
        """What the kubelet would report (there is none)."""
        body = {"status": {"phase": phase, **status}}
        self.kubectl(
            "patch", "pod", name, "-n", ns, "--subresource=status", "--type=strategic",
            "-p", json.dumps(body),
        )  # fmt: skip

    def finish_pod(self, ns: str, name: str) -> None:
        """What the kubelet does to a deleted pod once its containers stopped."""
        self.kubectl(
            "delete", "pod", name, "-n", ns, "--grace-period=0", "--force", "--wait=false",
            check=False,
        )  # fmt: skip

    def wait(self, what: str, fn: Any, timeout: float = 60.0, every: float = 0.3) -> Any:
        """Poll ``fn()`` until it returns something truthy; fail naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            got = fn()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(every)

    def token_kubeconfig(self, namespace: str, sa: str, path: Path) -> Path:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/sa``."""
        token = self.kubectl("create", "token", sa, "-n", namespace, "--duration=6h").stdout
        admin = json.loads(self.kubectl("config", "view", "--raw", "-o", "json").stdout)
        cluster = admin["clusters"][0]["cluster"]
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": cluster}],
                    "users": [{"name": sa, "user": {"token": token.strip()}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": sa}}],
                    "current-context": "x",
                }
            )
        )
        path.chmod(0o600)
        return path

    def served(self, group_version: str, resource: str) -> bool:
        """Whether discovery lists ``resource`` in ``group_version`` (e.g. resource.k8s.io/v1)."""
        proc = self.kubectl("get", "--raw", f"/apis/{group_version}", check=False)
        if proc.returncode != 0:
            return False
        return any(r["name"] == resource for r in json.loads(proc.stdout)["resources"])


def _missing() -> str | None:
    b = bin_dir()
    absent = [n for n in BINARIES if not (b / n).is_file()]
    if absent:
        return (
            f"no {', '.join(absent)} in {b}: the Kubernetes tests need a real kube-apiserver "
            "(./run test builds it with Go once, 20-30 min: tools/kube-apiserver/install.sh "
            "--with-controllers)"
        )
    if not shutil.which("openssl"):
        return "openssl not found (tools/kube-apiserver/start.sh makes the certificates)"
    return None


def start_cluster(workdir: Path) -> KubeCluster:
    """Start the servers in ``workdir`` and install the shipped manifests (see module doc)."""
    env = {**os.environ, "C4K8S_BIN": str(bin_dir())}
    controllers = all((bin_dir() / n).is_file() for n in CONTROLLERS)
    proc = subprocess.run(
        [str(TOOLS / "start.sh"), str(workdir), *(["--with-controllers"] if controllers else [])],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tools/kube-apiserver/start.sh failed: {proc.stderr.strip()[-2000:]}")
    out = subprocess.run(
        [str(bin_dir() / "kube-apiserver"), "--version"], capture_output=True, text=True
    )
    version = out.stdout.strip().removeprefix("Kubernetes v")
    cluster = KubeCluster(
        workdir=workdir,
        kubeconfig=Path(proc.stdout.strip().splitlines()[-1]),
        actuator_kubeconfig=workdir / "actuator.kubeconfig",
        version=version,
        bin=bin_dir(),
        controllers=controllers,
    )
    for name in MANIFESTS:
        cluster.kubectl("apply", "-f", str(K8S / name))
    cluster.token_kubeconfig(*ACTUATOR_SA, cluster.actuator_kubeconfig)
    return cluster


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    """The session's Kubernetes API server (see the module docstring); skips without it."""
    why = _missing()
    if why:
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="c4k8s-"))
    try:
        cluster = start_cluster(workdir)
    except Exception:
        subprocess.run([str(TOOLS / "stop.sh"), str(workdir)], capture_output=True, timeout=60)
        raise
    try:
        yield cluster
    finally:
        subprocess.run([str(TOOLS / "stop.sh"), str(workdir)], capture_output=True, timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)
