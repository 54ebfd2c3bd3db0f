"""Generated CRI protobuf/gRPC modules (see proto/ and scripts/gen-proto.sh)."""
