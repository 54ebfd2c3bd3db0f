"""The CRI gRPC server of vmsandbox."""
