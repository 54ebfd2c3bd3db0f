#!/usr/bin/env bash
# Build the one-node cluster's Kubernetes, etcd, containerd, cri-tools and CoreDNS binaries from Go
# modules.
#
#   scripts/build-k8s.sh [PIN]        PIN: 1.37 (default) or 1.34; also K8S_PIN=1.34
#   KUBE_BIN=$(scripts/build-k8s.sh | tail -1)
#
# A pin is a directory tools/k8s/v<PIN>/ of Go modules, each with its go.mod and go.sum (the versions,
# fetched through the Go module proxy into the module cache) and `tool` directives naming the
# commands it builds:
#   kubernetes/  kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy
#   etcd/        etcd
#   containerd/  containerd containerd-shim-runc-v2 ctr
#   cri-tools/   crictl critest (a test binary: go test -c)
#   coredns/     coredns (main.go: the stock server with the plugins the cluster's Corefile uses)
# Each module is built on its own, so every command gets the dependency versions its own release
# was built with (one module would raise them all to the highest any of them asks for).
#
# Binaries go to $K8S_CACHE/<PIN>/bin (default /var/cache/vmsandbox/k8s/1.37/bin), outside the work
# tree so a fresh clone on the same machine finds them. A module is built again only when its stamp
# changes: the hash of its go.mod, go.sum and Go files, the Go version, GOOS/GOARCH and this script
# (or when one of its binaries is missing). Progress and timings go to stderr; the last line on
# stdout is the bin directory. Runs one at a time per pin (flock); exits non-zero when a build fails.
# Needs Go 1.26.6 or newer (/usr/local/go/bin/go, else the go on PATH); builds under nice -n 10.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
SCRIPT=$ROOT/scripts/build-k8s.sh

PIN=${1:-${K8S_PIN:-1.37}}
PIN=${PIN#v}
TOOLS=$ROOT/tools/k8s/v$PIN
CACHE=${K8S_CACHE:-/var/cache/vmsandbox/k8s}/$PIN
BIN=$CACHE/bin
MODULES=(kubernetes etcd containerd cri-tools coredns)

say() { echo "build-k8s.sh: $*" >&2; }
die() { say "$*"; exit 1; }

if [[ ! -d $TOOLS ]]; then
    pins=$(cd "$ROOT/tools/k8s" && ls -d v*/ 2>/dev/null | tr -d / | sed 's/^v//' | tr '\n' ' ')
    die "no pin $PIN (tools/k8s/v$PIN is missing); pins: ${pins:-none}"
fi

GO=/usr/local/go/bin/go
[[ -x $GO ]] || GO=$(command -v go || true)
[[ -n $GO ]] || die "go is missing (Go 1.26.6 or newer, in /usr/local/go or on PATH)"
# The go command may not fetch another toolchain nor change go.mod; a go.work above does not count.
export GOTOOLCHAIN=local GO111MODULE=on GOWORK=off GOFLAGS="-mod=readonly -buildvcs=false"
export HOME=${HOME:-/root}
GOVERSION=$("$GO" env GOVERSION)
if [[ ! $GOVERSION =~ ^go1\.([0-9]+)(\.([0-9]+))? ]] ||
    ((BASH_REMATCH[1] < 26 || (BASH_REMATCH[1] == 26 && ${BASH_REMATCH[3]:-0} < 6))); then
    die "$GO is $GOVERSION; these modules need Go 1.26.6 or newer"
fi
GOPLATFORM=$("$GO" env GOOS)/$("$GO" env GOARCH)

mkdir -p "$BIN" "$CACHE/stamps"
exec 9>"$CACHE/lock"
if ! flock -n 9; then
    say "another build of pin $PIN is running; waiting for it"
    flock 9
fi

# binaries each module puts in $BIN
binaries() {
    case $1 in
    kubernetes) echo kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy ;;
    etcd) echo etcd ;;
    containerd) echo containerd containerd-shim-runc-v2 ctr ;;
    cri-tools) echo crictl critest ;;
    coredns) echo coredns ;;
    esac
}

stamp() {
    (
        cd "$TOOLS/$1"
        cat go.mod go.sum ./*.go 2>/dev/null
        echo "$GOVERSION $GOPLATFORM"
        cat "$SCRIPT"
    ) | sha256sum | cut -d' ' -f1
}

up_to_date() {
    local b
    [[ $(cat "$CACHE/stamps/$1" 2>/dev/null || true) == "$2" ]] || return 1
    for b in $(binaries "$1"); do [[ -x $BIN/$b ]] || return 1; done
}

# go, niced, in the module's directory
gom() { (cd "$TOOLS/$MOD" && nice -n 10 "$GO" "$@"); }
modversion() { gom list -m -f '{{.Version}}' "$1"; }
# the release's time, as its build date: the same sources give the same binary
modtime() { gom list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' "$1"; }

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# Each build_<module> writes its binaries into $OUT. The flags follow each project's own release
# build; everything is built without cgo (the Kubernetes commands and containerd's shim are static
# in their releases too; the kubelet and containerd use cgo only for the C resolver, os/user and,
# in containerd, the btrfs snapshotter, left out here as `no_btrfs` does).
build_kubernetes() {
    local v date major minor ld="-s -w" p
    v=$(modversion k8s.io/kubernetes)
    date=$(modtime k8s.io/kubernetes)
    [[ $v =~ ^v([0-9]+)\.([0-9]+)\. ]] || die "k8s.io/kubernetes $v is not vX.Y.Z"
    major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
    # what hack/lib/version.sh sets; the module carries no commit id
    for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
        ld+=" -X $p.gitVersion=$v -X $p.gitMajor=$major -X $p.gitMinor=$minor"
        ld+=" -X $p.gitCommit= -X $p.gitTreeState=clean -X $p.buildDate=$date"
    done
    fetch tool
    CGO_ENABLED=0 gom build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ld" -o "$OUT/" tool
}

build_etcd() {
    fetch go.etcd.io/etcd/server/v3
    # the server module's root package is the etcd command; "GitNotFound" is what etcd's build
    # script stamps when it has no git either
    CGO_ENABLED=0 gom build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=GitNotFound" \
        -o "$OUT/etcd" go.etcd.io/etcd/server/v3
}

build_containerd() {
    local v p=github.com/containerd/containerd/v2 ld
    v=$(modversion $p)
    ld="-s -w -X $p/version.Version=$v -X $p/version.Revision= -X $p/version.Package=$p"
    fetch tool
    CGO_ENABLED=0 gom build -trimpath -tags "urfave_cli_no_docs no_btrfs" -ldflags "$ld" \
        -o "$OUT/" $p/cmd/containerd $p/cmd/ctr
    CGO_ENABLED=0 gom build -trimpath -tags "urfave_cli_no_docs no_grpc" -ldflags "$ld" \
        -o "$OUT/containerd-shim-runc-v2" $p/cmd/containerd-shim-runc-v2
}

build_cri-tools() {
    local v p=sigs.k8s.io/cri-tools ld
    v=$(modversion $p)
    ld="-s -w -X $p/pkg/version.Version=${v#v}"
    fetch -test $p/cmd/crictl $p/cmd/critest
    CGO_ENABLED=0 gom build -trimpath -ldflags "$ld" -o "$OUT/crictl" $p/cmd/crictl
    CGO_ENABLED=0 gom test -c -trimpath -ldflags "$ld" -o "$OUT/critest" $p/cmd/critest
}

build_coredns() {
    local v p=github.com/coredns/coredns
    v=$(modversion $p)
    fetch .
    # CoreDNS's Makefile stamps the commit the same way; the module has none, so its version
    CGO_ENABLED=0 gom build -trimpath -ldflags "-s -w -X $p/coremain.GitCommit=$v" -o "$OUT/coredns" .
}

# bring the modules the packages need into the module cache first, so that the download is timed
# on its own
fetch() {
    local t
    t=$(now)
    gom list -deps "$@" >/dev/null
    say "  modules for $MOD ready in $(since "$t") s"
}

# a line of what each binary says it is (read whole: cutting it short would SIGPIPE the binary)
versions() {
    local b out
    for b in $(binaries "$1"); do
        case $b in
        kubectl) out=$("$BIN/$b" version --client 2>&1) ;;
        containerd-shim-runc-v2) out=$("$BIN/$b" -v 2>&1) ;;
        coredns) out=$("$BIN/$b" -version 2>&1 | tr '\n' ' ') ;;
        *) out=$("$BIN/$b" --version 2>&1) ;;
        esac || die "$BIN/$b does not run: $out"
        [[ $b != critest ]] || out=$(grep -m1 version <<<"$out")
        [[ $b != containerd-shim-runc-v2 ]] || out=$(head -2 <<<"$out" | tr -s '\n ' '  ')
        say "  $b: ${out%%$'\n'*}"
    done
}

# a failed go command ends the script (set -e); this says what failed and removes the partial output
MOD= OUT=
on_exit() {
    local rc=$?
    [[ -z $OUT ]] || rm -rf "$OUT"
    if ((rc != 0)) && [[ -n $MOD ]]; then
        say "building $MOD of pin $PIN failed (exit $rc; go's output above; module tools/k8s/v$PIN/$MOD)"
    fi
}
trap on_exit EXIT

total=$(now)
built=0
for MOD in "${MODULES[@]}"; do
    [[ -f $TOOLS/$MOD/go.mod ]] || die "tools/k8s/v$PIN/$MOD/go.mod is missing"
    s=$(stamp "$MOD")
    if up_to_date "$MOD" "$s"; then
        say "$MOD: up to date"
        continue
    fi
    say "$MOD: building ($(binaries "$MOD"))"
    t=$(now)
    OUT=$(mktemp -d "$CACHE/build.XXXXXX")
    "build_$MOD"
    for b in $(binaries "$MOD"); do
        [[ -x $OUT/$b ]] || die "building $MOD left no $b"
        mv -f "$OUT/$b" "$BIN/$b" # a rename: a running binary keeps its file
    done
    rm -rf "$OUT"
    OUT=
    say "$MOD: built in $(since "$t") s"
    versions "$MOD"
    echo "$s" >"$CACHE/stamps/$MOD"
    built=$((built + 1))
done
MOD=
say "pin $PIN: $built of ${#MODULES[@]} modules built, $(since "$total") s in all; binaries in $BIN"
echo "$BIN"
