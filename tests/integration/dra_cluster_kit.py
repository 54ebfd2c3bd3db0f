"""What the DRA cluster tests share: the one-node cluster with vmsandbox's DRA driver
(``CLUSTER_DRA=1``: the network ``net1`` on the bridge ``vmsbr-dra0``, 10.240.0.1/24 on the host)
and readers of what the driver keeps and the host holds."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.integration.cluster_support import Cluster, running_cluster

DRIVER = "vmsandbox.dev"
BRIDGE = "vmsbr-dra0"  # scripts/cluster.sh's DRA bridge, 10.240.0.1/24 on the host


def dra_cluster(mode: str = "proxy") -> Iterator[Cluster]:
    """A module fixture's body: the cluster with the DRA driver in ``mode`` (``running_cluster``'s),
    the environment as it was afterwards."""
    before = os.environ.get("CLUSTER_DRA")
    os.environ["CLUSTER_DRA"] = "1"
    try:
        yield from running_cluster(mode=mode)
    finally:
        if before is None:
            os.environ.pop("CLUSTER_DRA", None)
        else:
            os.environ["CLUSTER_DRA"] = before


def kube_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def records(cluster: Cluster, kind: str) -> list[dict[str, Any]]:
    """The driver's records under ``<state_dir>/dra/<kind>``: ``claims`` (prepared claims) or
    ``runc`` (ordinary pods' links)."""
    directory = cluster.state_dir / "dra" / kind
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))] if directory.is_dir() else []


def stored_claims(cluster: Cluster) -> list[dict[str, Any]]:
    return records(cluster, "claims")


def bridge_ports() -> list[str]:
    """The ports of the DRA bridge: VM pods' taps and ordinary pods' veths."""
    brif = Path("/sys/class/net", BRIDGE, "brif")
    return sorted(p.name for p in brif.iterdir()) if brif.is_dir() else []


def our_veths() -> list[str]:
    """The host ends of ordinary pods' claimed devices (``vdr...``), as ``ip -o link`` lists them."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return sorted(m.group(1) for m in re.finditer(r"^\d+: (vdr[0-9a-f]+)[@:]", out, re.M))
