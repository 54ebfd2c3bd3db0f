#!/usr/bin/env bash
# Build containerd/nri's own sample plugins (logger, ulimit-adjuster), offline.
#
#   tests/nri_plugin/build-stock.sh NRI_SRC CONTAINERD_SRC OUT_DIR
#
# NRI_SRC is a containerd/nri checkout (its plugins/ have go.mod files of their own, whose
# modules cannot be downloaded here); CONTAINERD_SRC an export of containerd/containerd, which
# vendors everything those two plugins import (nri's stub, ttrpc, logrus, sigs.k8s.io/yaml).
# Each plugin's sources are copied into that module tree and built with -mod=vendor, as
# tests/nri_plugin/build.sh builds our test plugin. OUT_DIR gets logger and ulimit-adjuster;
# tests/integration/test_nri_stock_plugins.py runs them when NRI_STOCK_PLUGINS=OUT_DIR.
set -euo pipefail

nri="${1:?usage: build-stock.sh NRI_SRC CONTAINERD_SRC OUT_DIR}"
src="${2:?usage: build-stock.sh NRI_SRC CONTAINERD_SRC OUT_DIR}"
out="$(realpath -m "${3:?usage: build-stock.sh NRI_SRC CONTAINERD_SRC OUT_DIR}")"
go="${GO:-go}"
mkdir -p "$out"
grep '^# github.com/containerd/nri ' "$src/vendor/modules.txt"
for plugin in logger ulimit-adjuster; do
    dir="$src/cmd/vmsandbox-nri-stock-$plugin"
    rm -rf "$dir"
    mkdir -p "$dir"
    find "$nri/plugins/$plugin" -maxdepth 1 -name '*.go' ! -name '*_test.go' -exec cp {} "$dir/" \;
    (cd "$src" && GOTOOLCHAIN=local GOFLAGS=-mod=vendor GOPROXY=off CGO_ENABLED=0 \
        "$go" build -o "$out/$plugin" "./cmd/vmsandbox-nri-stock-$plugin")
    echo "built $out/$plugin"
done
