"""Generated protobuf modules of containerd's runtime shim API (see proto/gen/containerd/ and scripts/gen-proto.sh)."""
