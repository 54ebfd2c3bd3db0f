"""Generated protobuf modules of the NRI API and of ttrpc's request/response (see proto/vmsandbox/nri_pb/ and scripts/gen-proto.sh)."""
