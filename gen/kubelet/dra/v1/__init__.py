"""Generated stubs of k8s.io.kubelet.pkg.apis.dra.v1 (service DRAPlugin: api_pb2, api_pb2_grpc)."""
