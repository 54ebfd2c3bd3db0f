"""Generated stubs of the kubelet's Dynamic Resource Allocation plugin API."""
