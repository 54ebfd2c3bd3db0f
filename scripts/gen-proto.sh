#!/usr/bin/env bash
# Regenerate the Python stubs of the CRI contract, of the NRI API, of containerd's runtime shim
# API (the Sandbox and Task services, their types and events: shim mode) and of the kubelet's DRA
# plugin and plugin registration APIs (k8s.io/kubelet v0.37.2: the DRA driver) from proto/.
#
#   scripts/gen-proto.sh [OUT_DIR]
#
# OUT_DIR defaults to the repository root, where the generated modules are
# kept under gen/cri/, gen/nri/, gen/containerd/ and gen/kubelet/ (the proto files sit under proto/gen/ so that
# the generated modules import each other as gen.*) (tests/gen/test_proto_contract.py and
# tests/gen/test_nri_proto.py regenerate into a temporary directory and check
# they are up to date). The CRI and the kubelet's plugin APIs are gRPC, so proto/gen/cri/ and
# proto/gen/kubelet/ also get gRPC stubs;
# NRI and containerd's shims speak ttrpc (vmsandbox/ttrpc.py, shim/nri/, shim/containerd/), so
# proto/gen/nri/ and proto/gen/containerd/ get messages only. The interpreter is
# $PYTHON, default .venv/bin/python; it needs grpcio-tools and mypy-protobuf.
# Generated files are never edited by hand; only the __init__.py files under
# gen/ are written by people.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$repo_root/.venv/bin/python}"
out_dir="${1:-$repo_root}"

mkdir -p "$out_dir"
out_dir="$(cd "$out_dir" && pwd)"

# protoc-gen-mypy and protoc-gen-mypy_grpc live next to the interpreter's scripts.
scripts_dir="$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
export PATH="$scripts_dir:$PATH"

cd "$repo_root"
mapfile -t protos < <(cd proto && find gen/cri gen/kubelet -name '*.proto' -printf '%p\n' | LC_ALL=C sort)
mapfile -t ttrpc_protos < <(cd proto && find gen/nri gen/containerd -name '*.proto' -printf '%p\n' | LC_ALL=C sort)
if [ "${#protos[@]}" -eq 0 ] || [ "${#ttrpc_protos[@]}" -eq 0 ]; then
    echo "gen-proto: no .proto files under proto/gen/cri, proto/gen/kubelet, proto/gen/nri or proto/gen/containerd" >&2
    exit 1
fi

"$python" -m grpc_tools.protoc \
    -I proto \
    --python_out="$out_dir" \
    --grpc_python_out="$out_dir" \
    --mypy_out="$out_dir" \
    --mypy_grpc_out="$out_dir" \
    "${protos[@]/#/proto/}"

"$python" -m grpc_tools.protoc \
    -I proto \
    --python_out="$out_dir" \
    --mypy_out="$out_dir" \
    "${ttrpc_protos[@]/#/proto/}"
