"""The DRA driver's network devices for ordinary (runc) pods (pure).

The kubelet prepares a pod's claims of ``vmsandbox.dev`` whatever runs the pod; a VM pod's claimed
NICs are its domain's (``vmsandbox.dra.claimed_nics``), an ordinary pod's are made in its network
namespace when containerd tells NRI's RunPodSandbox (``shim.dra.nri_plugin``). This module decides
what is made and reads what is there:

* ``runc_nics``: each device of the pod's prepared claims as a link of its namespace: for a
  ``bridge`` network a veth pair (the host end, ``host_link``, a port of the bridge), for a
  ``macvlan`` one a macvlan on the network's host interface, moved into the namespace; named and
  addressed as the claim says (the same checks and names as a VM's NIC, MAC included).
* ``pod_netns``: the network namespace path among NRI's namespaces of the pod.
* ``made_record`` / ``made_from_record``: what was made for a pod, as it is kept on disk so that a
  crash leaves nothing behind that a later reconcile does not remove.
* ``nic_report``: the link in the pod's namespace as ``ip -j addr show dev NAME`` prints it, for the
  claim's ``status.devices[].networkData``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vmsandbox import validation
from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import ClaimedNic, NetworkAttachment, PreparedClaim, claimed_nics, is_pci
from vmsandbox.errors import InvalidArgument, Unsupported
from vmsandbox.given_netns import IpOutputError, parse_interfaces

HOST_LINK_PREFIX = "vdr"  # every host link made for a runc pod's claim starts so (and only those)
_HOST_LINK = re.compile(r"vdr[0-9a-f]{12}")
_SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_LINKS = 8  # the claimed NICs of one pod (vmsandbox.dra.MAX_CLAIMED_NICS)


@dataclass(frozen=True)
class RuncNic:
    """One claimed device as a link of an ordinary pod's network namespace: ``nic`` is what the
    pod sees (name, MAC, addresses, the network's kind and host interface); ``host_link`` is the
    host's end of a bridge network's veth pair ("" for a macvlan, which is made in the namespace
    and goes with it)."""

    nic: ClaimedNic
    host_link: str


@dataclass(frozen=True)
class RuncPod:
    """An ordinary pod as NRI tells of it: its sandbox id, uid, name, runtime handler and network
    namespace path ("" when NRI gives none)."""

    sandbox_id: str
    uid: str
    namespace: str
    name: str
    runtime_handler: str = ""
    netns: str = ""

    @property
    def full_name(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Made:
    """What was made for one pod: the host links to delete when it stops (or is found gone)."""

    sandbox_id: str
    pod_uid: str
    host_links: tuple[str, ...]


def host_link_name(sandbox_id: str, claim_uid: str, index: int) -> str:
    """The host link of a sandbox's ``index``-th claimed device: ``vdr`` and 12 hex digits of a hash
    (15 bytes, Linux's limit), so the name is known before the link is made and again after a crash."""
    digest = hashlib.sha256(f"runc/{sandbox_id}/{claim_uid}/{index}".encode()).hexdigest()
    return HOST_LINK_PREFIX + digest[:12]


def runc_nics(
    pod: str, sandbox_id: str, claims: Sequence[PreparedClaim], networks: Sequence[NetworkAttachment]
) -> tuple[RuncNic, ...]:
    """The links a pod's prepared claims put in its network namespace, in the claims' order, each
    with the claim's static addresses or those host-local gave it at NodePrepareResources, as a VM's
    NIC has. A PCI passthrough device (a VM's only) is refused (``Unsupported``); the rest is
    refused as a VM's NIC is (``claimed_nics``)."""
    for claim in claims:
        for device in claim.devices:
            if is_pci(device):
                raise Unsupported(
                    f"pod {pod}: claim {claim.namespace}/{claim.name} device {device.device} (request "
                    f"{device.request}) is a PCI passthrough device; vmsandbox passes devices through to VM "
                    "pods only, an ordinary pod cannot take one (docs/dra.md)"
                )
    nics = claimed_nics(pod, sandbox_id, claims, networks)
    uids = [c.uid for c in claims for _ in c.devices]
    return tuple(
        RuncNic(nic, host_link_name(sandbox_id, uids[i], i) if nic.kind == "bridge" else "")
        for i, nic in enumerate(nics)
    )


def pod_netns(namespaces: Sequence[tuple[str, str]]) -> str:
    """The path of the pod's network namespace among ``(type, path)`` pairs, as NRI gives them;
    "" when there is none (a host-network pod)."""
    return next((path for kind, path in namespaces if kind == "network"), "")


def check_netns(pod: RuncPod) -> str:
    """The pod's network namespace path; a pod without one of its own (host network) cannot take
    a claimed network device: InvalidArgument."""
    if not pod.netns:
        raise InvalidArgument(
            f"pod {pod.full_name} has no network namespace of its own (host network?): a claimed network "
            "device needs one"
        )
    return pod.netns


def made_record(made: Made) -> dict[str, Any]:
    return {"sandboxID": made.sandbox_id, "podUID": made.pod_uid, "hostLinks": list(made.host_links)}


def made_from_record(data: object) -> Made:
    """A record read back from disk: every field checked; a host link must be one of ours."""
    if not isinstance(data, Mapping):
        raise InvalidArgument("runc pod record: not a mapping")
    sandbox_id, pod_uid, links = data.get("sandboxID"), data.get("podUID"), data.get("hostLinks")
    if not isinstance(sandbox_id, str) or not _SANDBOX_ID.fullmatch(sandbox_id):
        raise InvalidArgument(f"runc pod record: sandboxID {validation.quote(str(sandbox_id)[:80])} is not an id")
    if not isinstance(pod_uid, str) or len(pod_uid) > 128:
        raise InvalidArgument("runc pod record: podUID is not a string of at most 128 characters")
    if not isinstance(links, list) or len(links) > MAX_LINKS:
        raise InvalidArgument(f"runc pod record: hostLinks is not a list of at most {MAX_LINKS}")
    for link in links:
        if not isinstance(link, str) or not _HOST_LINK.fullmatch(link):
            raise InvalidArgument(f"runc pod record: {validation.quote(str(link)[:40])} is not a link vmsandbox makes")
    return Made(sandbox_id, pod_uid, tuple(links))


def check_sandbox_id(sandbox_id: str) -> str:
    """A sandbox id as the record's file name takes it."""
    if not _SANDBOX_ID.fullmatch(sandbox_id):
        raise InvalidArgument(f"sandbox id {validation.quote(sandbox_id[:80])} is not an id")
    return sandbox_id


def nic_report(text: str, name: str) -> NicReport:
    """The link ``name`` as ``ip -j addr show dev NAME`` prints it (bounded, parsed defensively):
    its MAC and CIDRs; IpOutputError when it is not there."""
    found = [i for i in parse_interfaces(text) if i.name == name]
    if len(found) != 1:
        raise IpOutputError(f"ip -j addr show dev {name}: {len(found)} interfaces of that name")
    (link,) = found
    return NicReport(name=name, mac=link.mac.lower(), addresses=tuple(a.cidr for a in link.addresses), up=True)
