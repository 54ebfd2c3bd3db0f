"""Shim mode: vmsandbox as containerd's runtime shim (``io.containerd.vmsandbox.v1``, sandbox API).

containerd keeps the CRI socket; a RuntimeClass handler maps to vmsandbox's runtime type with
``sandboxer = "shim"``. The launcher containerd runs (``launch``) answers with the ttrpc socket
vmsandbox serves that handler on (``front``), whose Sandbox and Task services
(``sandbox_service``, ``task_service``) make pods and containers by the same RPCs as the CRI
socket. See docs/containerd-shim.md.
"""
