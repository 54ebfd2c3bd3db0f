"""Generated stubs for CRI runtime.v1 (api_pb2, api_pb2_grpc)."""
