#!/usr/bin/env bash
# Build the CRI front (front/: Go, its standard library and Debian's golang.org/x/net, which
# golang-golang-x-net-dev installs below /usr/share/gocode) into OUT, by default
# /usr/local/libexec/vmsandbox/vmsandbox-front (the shim's default front_binary). Builds again
# only when its sources, Go or x/net changed. Prints "built" or "up to date".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-/usr/local/libexec/vmsandbox/vmsandbox-front}
GOPATH_DEBIAN=/usr/share/gocode
if [[ ! -d $GOPATH_DEBIAN/src/golang.org/x/net/http2/hpack ]]; then
    echo "build-front.sh: $GOPATH_DEBIAN/src/golang.org/x/net/http2 is missing (apt-get install golang-golang-x-net-dev)" >&2
    exit 1
fi
command -v go >/dev/null || { echo "build-front.sh: go is missing (apt-get install golang-go)" >&2; exit 1; }
stamp=$( (cat front/*.go; go version; dpkg-query -W golang-golang-x-net-dev 2>/dev/null || true) | sha256sum | cut -d' ' -f1)
if [[ -x $OUT && $(cat "$OUT.stamp" 2>/dev/null || true) == "$stamp" ]]; then
    echo "up to date"
    exit 0
fi
mkdir -p "$(dirname "$OUT")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# GOPATH mode: the one dependency is Debian's source tree, no module download
(cd front && GO111MODULE=off GOPATH=$GOPATH_DEBIAN CGO_ENABLED=0 GOFLAGS= \
    go build -trimpath -ldflags='-s -w' -o "$tmp/vmsandbox-front" .)
install -m 0755 "$tmp/vmsandbox-front" "$OUT"
echo "$stamp" >"$OUT.stamp"
echo "built"
