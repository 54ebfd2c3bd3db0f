"""Generated protobuf modules of the NRI API and of ttrpc's request/response (see proto/shim/nri/pb/ and scripts/gen-proto.sh)."""
