"""vmsandbox's Dynamic Resource Allocation driver (docs/dra.md): the kubelet plugin's gRPC services
and registration (``shim.dra.plugin``), the prepared claims kept across restarts
(``shim.dra.store``), the node's ResourceSlices (``shim.dra.slices``) and the API server client they
use (``shim.dra.kube``). The rules are the core's, ``vmsandbox.dra``."""
