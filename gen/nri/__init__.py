"""Generated protobuf modules of the NRI API and of ttrpc's request/response (see proto/gen/nri/ and scripts/gen-proto.sh)."""
