"""The CRI proxy: vmsandbox in front of a downstream CRI runtime (``downstream_endpoint``).

``downstream`` owns the connection to the downstream runtime, ``ids`` the map of which ids
the downstream owns, ``service`` the gRPC handlers that route each call (decisions in
``vmsandbox.routing``) and ``images`` the image rule over both stores.
"""
