#!/usr/bin/env bash
# Build the NRI test plugin against containerd/nri's stub, offline.
#
#   tests/nri_plugin/build.sh CONTAINERD_SRC OUT_BINARY
#
# CONTAINERD_SRC is an export of a containerd/containerd checkout, which vendors
# github.com/containerd/nri (stub included) and github.com/containerd/ttrpc: the
# plugin's source is copied into that module tree and built with -mod=vendor, so
# nothing is downloaded. GO (default: go on PATH) is the toolchain.
set -euo pipefail

src="${1:?usage: build.sh CONTAINERD_SRC OUT_BINARY}"
out="${2:?usage: build.sh CONTAINERD_SRC OUT_BINARY}"
go="${GO:-go}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

grep -q '^# github.com/containerd/nri ' "$src/vendor/modules.txt" || {
    echo "build.sh: $src does not vendor github.com/containerd/nri" >&2
    exit 1
}
dir="$src/cmd/vmsandbox-nri-testplugin"
mkdir -p "$dir"
cp "$here/main.go" "$dir/main.go"
out="$(realpath -m "$out")"
cd "$src"
GOTOOLCHAIN=local GOFLAGS=-mod=vendor GOPROXY=off CGO_ENABLED=0 \
    "$go" build -o "$out" ./cmd/vmsandbox-nri-testplugin
grep '^# github.com/containerd/\(nri\|ttrpc\) ' "$src/vendor/modules.txt"
