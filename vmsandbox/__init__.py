"""vmsandbox: VM-isolated Kubernetes pods, sized once from the pod's full resource declaration."""

__version__ = "0.1.0"
