"""Generated stubs of the kubelet's plugin APIs, k8s.io/kubelet v0.37.2 (see proto/ and scripts/gen-proto.sh)."""
