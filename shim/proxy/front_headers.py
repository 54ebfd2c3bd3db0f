"""What the front (``front/``) and the shim tell each other in gRPC metadata, and the shim's
internal service the front calls. The front drops every ``vmsandbox-`` field a client sends, and
the shim honours these only when a front reads the CRI socket.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import unquote

OWNER = "vmsandbox-owner"  # reply: the exact id of this call is the downstream's ("downstream")
SIDE = "vmsandbox-side"  # request: answer vmsandbox's own side of a list only ("vmsandbox")
DOWNSTREAM = "vmsandbox-downstream"  # request: the downstream just failed this call; the value says why
LIST = "vmsandbox-list"  # SawList: which list its bytes are (ListPodSandbox, ListContainers)
PREFIX = "vmsandbox-"
SERVICE = "vmsandbox.internal.Front"  # SawList: the downstream's reply to an unfiltered list


def value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The value of ``key`` (percent-decoded, as the front encodes it), None when absent."""
    for k, v in metadata or ():
        if k == key:
            return unquote(v.decode() if isinstance(v, bytes) else v)
    return None
