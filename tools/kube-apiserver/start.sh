#!/usr/bin/env bash
# start.sh WORKDIR [--with-controllers] — start etcd + a real kube-apiserver on 127.0.0.1,
# in the background (with --with-controllers also kube-controller-manager and
# kube-scheduler: Jobs then make pods and pods get scheduled; see README.md).
#
# Everything lives in WORKDIR: pki/ (a CA, the serving cert, an admin client cert, the
# service-account signing key pair, all made here with openssl), etcd/ (data), *.log,
# pids (what stop.sh kills) and admin.kubeconfig (system:masters), whose path is printed
# last on stdout. Ports are free ones picked now, or APISERVER_PORT / ETCD_PORT.
# Authorization Node,RBAC; admission includes ValidatingAdmissionPolicy (GA since 1.30).
# --endpoint-reconciler-type none: from 1.37 kube-apiserver refuses to start when it
# advertises a loopback address with the default (lease) reconciler of the "kubernetes"
# Service's endpoints ("may not be in the loopback range"; 1.34 only logged it). No pod
# here needs that Service.
# DRA device taints (resource.k8s.io/v1 DeviceTaintRule, feature gates DRADeviceTaints and
# DRADeviceTaintRules) are GA and on by default in 1.37, so no gate is set here; for an
# older version pass them yourself, e.g.
#   C4K8S_APISERVER_ARGS="--feature-gates=DRADeviceTaints=true,DRADeviceTaintRules=true
#     --runtime-config=resource.k8s.io/v1beta2=true" start.sh WORKDIR
# (C4K8S_CONTROLLER_ARGS likewise for kube-controller-manager and kube-scheduler).
# There is never a kubelet: Node objects are plain objects (kubectl create -f node.yaml),
# pods stay Pending unless you patch their status. Without --with-controllers, pods
# bound with spec.nodeName stay as written and each namespace's "default"
# ServiceAccount must be created by hand (kubectl create sa default) before pods can be.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: start.sh WORKDIR [--with-controllers]" >&2; exit 64; }
W=$(mkdir -p "$1" && cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${C4K8S_BIN:-$HOME/.cache/c4stream-k8s/bin}
for b in kube-apiserver etcd; do [ -x "$BIN/$b" ] || { echo "start.sh: no $BIN/$b: run $HERE/install.sh first" >&2; exit 1; }; done
[ -s "$W/pids" ] && { echo "start.sh: $W/pids exists: run stop.sh $W first" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
AP=${APISERVER_PORT:-$(free_port)}; EP=${ETCD_PORT:-$(free_port)}; PP=$(free_port)

# 1. Certificates (once per WORKDIR; kept on restart).
P=$W/pki; mkdir -p "$P"
if [ ! -s "$P/admin.crt" ]; then
  ssl() { openssl "$@" 2>>"$W/openssl.log"; }
  ssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=c4stream-test-ca" -keyout "$P/ca.key" -out "$P/ca.crt"
  sign() {  # sign NAME SUBJECT [EXTFILE-LINES]: a key and a cert signed by the CA
    ssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$P/$1.key" -out "$P/$1.csr"
    printf '%s\n' "${3:-extendedKeyUsage=clientAuth}" >"$P/$1.ext"
    ssl x509 -req -in "$P/$1.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -days 3650 -extfile "$P/$1.ext" -out "$P/$1.crt"
  }
  sign apiserver "/CN=kube-apiserver" "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc
extendedKeyUsage=serverAuth"
  sign admin "/O=system:masters/CN=admin"
  ssl genrsa -out "$P/sa.key" 2048 && ssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub"
fi

# 2. etcd on loopback; fsync off (test data only).
nohup "$BIN/etcd" --name c4k8s --data-dir "$W/etcd" --unsafe-no-fsync \
  --listen-client-urls "http://127.0.0.1:$EP" --advertise-client-urls "http://127.0.0.1:$EP" \
  --listen-peer-urls "http://127.0.0.1:$PP" --initial-advertise-peer-urls "http://127.0.0.1:$PP" \
  --initial-cluster "c4k8s=http://127.0.0.1:$PP" >"$W/etcd.log" 2>&1 &
echo "$!" >"$W/pids"

# 3. kube-apiserver on loopback.
nohup "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$EP" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$AP" \
  --tls-cert-file "$P/apiserver.crt" --tls-private-key-file "$P/apiserver.key" \
  --client-ca-file "$P/ca.crt" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$P/sa.pub" --service-account-signing-key-file "$P/sa.key" \
  --service-cluster-ip-range 10.0.0.0/24 \
  --authorization-mode Node,RBAC \
  --endpoint-reconciler-type none \
  --enable-admission-plugins NodeRestriction,ValidatingAdmissionPolicy \
  --profiling=false ${C4K8S_APISERVER_ARGS:-} >"$W/kube-apiserver.log" 2>&1 &
echo "$!" >>"$W/pids"

# 4. The admin kubeconfig (system:masters).
cat >"$W/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: c4k8s
  cluster: {server: "https://127.0.0.1:$AP", certificate-authority: "$P/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$P/admin.crt", client-key: "$P/admin.key"}
contexts:
- name: c4k8s
  context: {cluster: c4k8s, user: admin}
current-context: c4k8s
EOF

# 5. Optional controllers, as admin. Without a kubelet the node-lifecycle controller
# would mark every node unreachable (and taint it NoExecute) after 40 s: its grace
# periods are set to a year, so a node whose status says Ready stays Ready.
start_controllers() {
  for b in kube-controller-manager kube-scheduler; do
    [ -x "$BIN/$b" ] || { echo "start.sh: no $BIN/$b: run $HERE/install.sh --with-controllers first" >&2; "$HERE/stop.sh" "$W"; exit 1; }
  done
  nohup "$BIN/kube-controller-manager" --kubeconfig "$W/admin.kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port 0 --use-service-account-credentials=false \
    --service-account-private-key-file "$P/sa.key" --root-ca-file "$P/ca.crt" \
    --node-monitor-grace-period 8760h --node-startup-grace-period 8760h ${C4K8S_CONTROLLER_ARGS:-} \
    >"$W/kube-controller-manager.log" 2>&1 &
  echo "$!" >>"$W/pids"
  nohup "$BIN/kube-scheduler" --kubeconfig "$W/admin.kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port 0 ${C4K8S_CONTROLLER_ARGS:-} >"$W/kube-scheduler.log" 2>&1 &
  echo "$!" >>"$W/pids"
}

# 6. Wait until /readyz says ok (about 10-30 s), else show the logs' tails and stop.
for _ in $(seq 120); do
  if curl -sf --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
       "https://127.0.0.1:$AP/readyz" 2>/dev/null | grep -qx ok; then
    [ "${2:-}" = --with-controllers ] && start_controllers
    echo "start.sh: kube-apiserver ready at https://127.0.0.1:$AP (etcd 127.0.0.1:$EP; pids $(tr '\n' ' ' <"$W/pids"))" >&2
    echo "$W/admin.kubeconfig"; exit 0
  fi
  sleep 1
done
echo "start.sh: not ready after 120 s" >&2; tail -n 5 "$W/etcd.log" "$W/kube-apiserver.log" >&2
"$HERE/stop.sh" "$W"; exit 1
