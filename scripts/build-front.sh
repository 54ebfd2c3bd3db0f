#!/usr/bin/env bash
# Build the CRI front (front/: a Go module, its dependencies pinned by front/go.mod and go.sum and
# fetched through the Go module proxy into the module cache) into OUT, by default
# /usr/local/libexec/vmsandbox/vmsandbox-front (the shim's default front_binary). Uses
# /usr/local/go/bin/go, else the go on PATH, and needs Go 1.26 or newer. Builds again only when
# its sources, go.mod, go.sum or Go changed. Prints "built" or "up to date".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-/usr/local/libexec/vmsandbox/vmsandbox-front}
GO=/usr/local/go/bin/go
[[ -x $GO ]] || GO=$(command -v go || true)
[[ -n $GO ]] || { echo "build-front.sh: go is missing (Go 1.26 or newer, in /usr/local/go or on PATH)" >&2; exit 1; }
# the go command may not fetch another toolchain nor change go.mod; the binary carries no VCS state
export GOTOOLCHAIN=local GO111MODULE=on GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
export HOME=${HOME:-/root}
version=$("$GO" env GOVERSION)
if [[ ! $version =~ ^go1\.([0-9]+) ]] || ((BASH_REMATCH[1] < 26)); then
    echo "build-front.sh: $GO is $version; the front needs Go 1.26 or newer" >&2
    exit 1
fi
stamp=$( (cat front/go.mod front/go.sum front/*.go; echo "$version") | sha256sum | cut -d' ' -f1)
if [[ -x $OUT && $(cat "$OUT.stamp" 2>/dev/null || true) == "$stamp" ]]; then
    echo "up to date"
    exit 0
fi
mkdir -p "$(dirname "$OUT")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd front && "$GO" build -trimpath -ldflags='-s -w' -o "$tmp/vmsandbox-front" .)
install -m 0755 "$tmp/vmsandbox-front" "$OUT"
echo "$stamp" >"$OUT.stamp"
echo "built"
