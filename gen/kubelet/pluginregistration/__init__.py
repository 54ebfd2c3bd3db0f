"""Generated stubs of the kubelet's plugin registration API."""
