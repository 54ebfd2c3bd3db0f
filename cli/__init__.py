"""The admin's tools, apart from the CRI server: the ``vmsandbox`` command (``serve`` starts the
server in ``shim.server``; ``plan``, ``profile validate``/``runtimeclass``, ``ls``, ``inspect``,
``logs`` work without it) and the demo client."""
