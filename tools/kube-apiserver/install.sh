#!/usr/bin/env bash
# install.sh — build once, then cache, a real kube-apiserver + etcd + kubectl for tests.
#
#   tools/kube-apiserver/install.sh                     # prints the binaries' paths
#   tools/kube-apiserver/install.sh --with-controllers  # + kube-controller-manager, kube-scheduler
#   K8S_VERSION=1.37.2 C4K8S_CACHE=~/.cache/c4stream-k8s tools/kube-apiserver/install.sh
#
# The version is a setting: tools/kube-apiserver/VERSION (1.37.2: DRA device taints,
# resource.k8s.io/v1 DeviceTaintRule, are GA there), overridden by K8S_VERSION.
#
# Everything comes from the Go module proxy through `go` (no download site, no image):
# k8s.io/kubernetes cannot be `go install`ed (its go.mod points the k8s.io/* staging
# modules at ./staging), so we write a small wrapper module that replaces each of them
# with its published v0.MINOR.PATCH twin and records the commands as `tool`s;
# etcd's server module is taken at the version k8s.io/kubernetes itself requires.
# Idempotent: binaries already built for this version are kept and only printed.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
VERSION=${K8S_VERSION:-$(cat "$HERE/VERSION")}       # >= 1.30: ValidatingAdmissionPolicy GA
CACHE=${C4K8S_CACHE:-$HOME/.cache/c4stream-k8s}
BIN=$CACHE/bin
SRC=$CACHE/src-$VERSION                             # the wrapper module
LOG=$CACHE/install.log
NAMES="kube-apiserver etcd kubectl"
[ "${1:-}" = --with-controllers ] && NAMES="$NAMES kube-controller-manager kube-scheduler"

die() { echo "install.sh: FAILED: $*" >&2; tail -n 3 "$LOG" >&2 2>/dev/null; echo "install.sh: details: $LOG" >&2; exit 1; }
say() { echo "install.sh: $*" >&2; }

have() {  # have NAME: the cached binary exists and is of this version (no pipe: pipefail)
  [ -x "$BIN/$1" ] || return 1
  local out
  case $1 in
    kube-*) out=$("$BIN/$1" --version 2>/dev/null) && [ "$out" = "Kubernetes v$VERSION" ] ;;
    kubectl) out=$("$BIN/kubectl" version --client 2>/dev/null) && [[ $out == *"Client Version: v$VERSION"* ]] ;;
    etcd) out=$("$BIN/etcd" --version 2>/dev/null) && [[ $out == *"etcd Version: "* ]] ;;
  esac
}

paths() { for n in $NAMES; do echo "$BIN/$n"; done; }
missing=""; for n in $NAMES; do have "$n" || missing="$missing $n"; done
[ -z "$missing" ] && { paths; exit 0; }

mkdir -p "$BIN" "$SRC"; : >"$LOG"
command -v go >/dev/null || die "no 'go' on PATH: install Go >= 1.24 first"
say "building$missing (Kubernetes v$VERSION) in $SRC (about 20-25 min on 2 cores; log: $LOG)"

# 1. The wrapper module: every k8s.io staging module replaced by its published version.
STAGING="api apiextensions-apiserver apimachinery apiserver cli-runtime client-go
  cloud-provider cluster-bootstrap code-generator component-base component-helpers
  controller-manager cri-api cri-client csi-translation-lib dynamic-resource-allocation
  endpointslice externaljwt kms kube-aggregator kube-controller-manager kube-proxy
  kube-scheduler kubectl kubelet metrics mount-utils pod-security-admission
  sample-apiserver sample-cli-plugin sample-controller"
{
  printf 'module c4stream-k8s-tools\n\ngo 1.24.0\n\nreplace (\n'
  for m in $STAGING; do printf '\tk8s.io/%s => k8s.io/%s v0.%s\n' "$m" "$m" "${VERSION#1.}"; done
  printf ')\n'
} >"$SRC/go.mod"
cd "$SRC"

# 2. Fetch the sources (about 0.6 GiB of modules; refused or unreachable -> stop here).
say "fetching k8s.io/kubernetes v$VERSION and its modules"
CMDS=""; for n in $NAMES; do [ "$n" = etcd ] || CMDS="$CMDS k8s.io/kubernetes/cmd/$n@v$VERSION"; done
# shellcheck disable=SC2086
go get -tool $CMDS >>"$LOG" 2>&1 ||
  die "the Go module proxy did not serve k8s.io/kubernetes@v$VERSION or one of its modules (see go env GOPROXY)"
ETCD=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3 2>>"$LOG") ||
  die "k8s.io/kubernetes@v$VERSION does not name an etcd server version"
go get -tool "go.etcd.io/etcd/server/v3@$ETCD" >>"$LOG" 2>&1 ||
  die "the Go module proxy did not serve go.etcd.io/etcd/server/v3@$ETCD"

# 3. Build, niced, static, with the version stamped as the release scripts do.
X="gitVersion=v$VERSION gitMajor=1 gitMinor=$(echo "$VERSION" | cut -d. -f2) gitTreeState=clean"
LDF="-s -w"
for kv in $X; do LDF="$LDF -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"; done
build() {  # build NAME PACKAGE
  have "$1" && { say "$1: cached"; return; }
  say "compiling $1 ($2)"; local t=$SECONDS
  CGO_ENABLED=0 nice -n 10 go build -mod=mod -trimpath -ldflags "$LDF" -o "$BIN/$1.new" "$2" >>"$LOG" 2>&1 ||
    die "go build $2 failed (out of disk or memory? the build cache takes ~1.5 GiB)"
  mv "$BIN/$1.new" "$BIN/$1"; say "$1: built in $((SECONDS - t)) s"
}
for n in $NAMES; do
  if [ "$n" = etcd ]; then build etcd go.etcd.io/etcd/server/v3; else build "$n" "k8s.io/kubernetes/cmd/$n"; fi
done
paths
