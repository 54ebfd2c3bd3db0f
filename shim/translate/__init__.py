"""Protobuf <-> core: the only package of the shim that reads or builds CRI messages' fields.

One module per side of the wire and per service: ``inbound`` (RuntimeService requests into core
specs, validated, ``InvalidArgument`` naming the field), ``outbound`` (records into the
RuntimeService's replies), ``images`` (the ImageService, both ways) and ``stats`` (the stats and
metrics replies).
"""
