"""Generated stubs of pluginregistration v1 (service Registration: api_pb2, api_pb2_grpc)."""
