"""vmsandbox.dra_select: DRA CEL selectors evaluated over the devices this node's vmsandbox publishes,
built by the functions that build its ResourceSlices (``network_device``, ``pci_device``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vmsandbox.test_dra_pci import PUBLISHED
from vmsandbox.dra import NetworkAttachment, PlannedRequest, network_device
from vmsandbox.dra_pci import pci_device
from vmsandbox.dra_select import (
    KNOWN_CLASSES,
    MAX_EXPRESSION,
    Selection,
    Selector,
    class_selectors,
    device_input,
    names_driver,
    select_claims,
    select_request,
)

DRIVER = "vmsandbox.dev"
LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24")
FAST = NetworkAttachment("fast", "macvlan", "eth1", "10.9.0.0/16", mode="vepa")
NETWORKS = [network_device(DRIVER, n) for n in (LAN, FAST)]
PCI = [pci_device(DRIVER, g) for g in PUBLISHED.values()]  # accel 17:00.0, then three 10de:2330 GPUs
DEVICES = NETWORKS + PCI
GPUS = ("pci-0000-3b-00-0", "pci-0000-af-00-0", "pci-0000-d8-00-0")
ALL_PCI = ("pci-0000-17-00-0", *GPUS)
NETWORK_CLASS = 'device.driver == "vmsandbox.dev" && device.attributes["vmsandbox.dev"].type == "network"'
PCI_CLASS = 'device.driver == "vmsandbox.dev" && device.attributes["vmsandbox.dev"].type == "pci"'
A = 'device.attributes["vmsandbox.dev"]'
NONE = Selection(
    reason="no vmsandbox.dev device of this node matches (published: lan, fast, " + ", ".join(ALL_PCI) + ")"
)


def sel(*expressions: str) -> tuple[Selector, ...]:
    return tuple(Selector(f"selector {i}", e) for i, e in enumerate(expressions))


# -- what a selector sees -------------------------------------------------------------------------------
def test_the_device_input_groups_attributes_by_domain() -> None:
    gpu = device_input(DRIVER, PCI[1])
    assert gpu["driver"] == DRIVER
    assert gpu["attributes"][DRIVER]["vendor"] == "10de" and gpu["attributes"][DRIVER]["iommuGroup"] == 12
    assert gpu["attributes"]["resource.kubernetes.io"]["pciBusID"] == "0000:3b:00.0"
    assert gpu["attributes"]["other.example.com"] == {}  # a domain without attributes: an empty map
    assert gpu["capacity"] == {} and not gpu["allowMultipleAllocations"]  # one claim at a time
    assert device_input(DRIVER, NETWORKS[0])["allowMultipleAllocations"]  # a NIC for every pod on it


# -- one request over this node's devices ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("selectors", "mode", "count", "want"),
    [
        # the classes of deploy/dra/deviceclass.yaml
        (sel(NETWORK_CLASS), "ExactCount", 1, Selection(("lan",), ("lan", "fast"))),
        (sel(PCI_CLASS), "ExactCount", 1, Selection(("pci-0000-17-00-0",), ALL_PCI)),
        (sel(f'{A}.type == "network"'), "All", 1, Selection(("lan", "fast"), ("lan", "fast"))),
        # a request's selector narrowing the class to one network: by kind, by subnet, by name of interface
        (sel(NETWORK_CLASS, f'{A}.kind == "macvlan"'), "ExactCount", 1, Selection(("fast",), ("fast",))),
        (sel(NETWORK_CLASS, f'{A}.kind == "bridge"'), "ExactCount", 1, Selection(("lan",), ("lan",))),
        (sel(NETWORK_CLASS, f'{A}.subnet.startsWith("10.9.")'), "ExactCount", 1, Selection(("fast",), ("fast",))),
        (sel(NETWORK_CLASS, f'{A}.subnet == "192.168.50.0/24"'), "ExactCount", 1, Selection(("lan",), ("lan",))),
        (sel(NETWORK_CLASS, f'{A}.interface.matches("^br-")'), "ExactCount", 1, Selection(("lan",), ("lan",))),
        # PCI vendor and device id, the standard attributes, ints
        (sel(PCI_CLASS, f'{A}.vendor == "10de" && {A}.deviceID == "2330"'), "All", 1, Selection(GPUS, GPUS)),
        (sel(PCI_CLASS, f'{A}.vendor == "8086"'), "ExactCount", 1, Selection(ALL_PCI[:1], ALL_PCI[:1])),
        (
            sel(PCI_CLASS, 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:af:00.0"'),
            "ExactCount",
            1,
            Selection(("pci-0000-af-00-0",), ("pci-0000-af-00-0",)),
        ),
        (sel(PCI_CLASS, f"{A}.functions > 1"), "ExactCount", 2, Selection(GPUS[:2], GPUS[:2])),
        # a robust expression: has() before a numaNode the accelerator does not publish
        (
            sel(
                PCI_CLASS,
                'has(device.attributes["resource.kubernetes.io"].numaNode) && '
                'device.attributes["resource.kubernetes.io"].numaNode == 1',
            ),
            "All",
            1,
            Selection(GPUS[1:], GPUS[1:]),
        ),
        # count: the first N of the matches, in the order published
        (sel(PCI_CLASS), "ExactCount", 3, Selection(ALL_PCI[:3], ALL_PCI)),
        # another driver's class matches none of this node's vmsandbox devices
        (
            sel('device.driver == "gpu.example.com" && device.attributes["gpu.example.com"].model == "x"'),
            "ExactCount",
            1,
            NONE,
        ),
        # a domain the device has nothing in is an empty map: has() on it is false, not an error
        (sel('has(device.attributes["gpu.example.com"].model)'), "All", 1, NONE),
        (
            sel(NETWORK_CLASS),
            "ExactCount",
            3,
            Selection((), ("lan", "fast"), "asks for 3, 2 of this node's vmsandbox.dev devices match"),
        ),
    ],
)
def test_select_request(selectors: tuple[Selector, ...], mode: str, count: int, want: Selection) -> None:
    assert select_request("resourceClaims c request r", selectors, DRIVER, DEVICES, mode, count) == want


# -- errors: the scheduler aborts the claim's allocation ---------------------------------------------------
LONG = "true && " * (MAX_EXPRESSION // 8) + "true"


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        # does not compile
        (
            f'{A}.type == "network" &&',
            'selector 0 "device.attributes[\\"vmsandbox.dev\\"].type == \\"network\\" &&": does not compile',
        ),
        ("device.", "does not compile"),
        # a name the device does not have: an evaluation error for the device, as the API says
        (f'{A}.model == "x"', "device lan: no such member in mapping: 'model'"),
        (f'{A}.vendor == "10de"', "device lan: no such member in mapping: 'vendor'"),
        ('device.attributes["gpu.example.com"].model == "x"', "device lan: no such member in mapping: 'model'"),
        # not a bool, a type mismatch, a name that is not declared
        (f"{A}.type", "device lan: the result is StringType, not a bool"),
        (f"{A}.type == 1", "device lan: found no matching overload"),
        ("node.name == 'a'", "device lan: undeclared reference to 'node'"),
        # Kubernetes' extension libraries are not in plan's CEL
        (f'cel.bind(a, {A}, a.type == "network")', "device lan: "),
        # longer than the API server takes
        (LONG, f"{len(LONG)} characters, more than the API's 10240"),
    ],
)
def test_a_selector_that_fails_is_an_error_naming_the_claim_request_and_expression(
    expression: str, message: str
) -> None:
    got = select_request("resourceClaims c request r", sel(expression), DRIVER, DEVICES)
    assert got.devices == () and got.matches == ()
    assert got.error.startswith('resourceClaims c request r: selector 0 "')
    assert message in got.error, got.error
    assert len(got.error) < 600  # the expression quoted is bounded


def test_a_missing_attribute_on_a_later_device_fails_the_request() -> None:
    # the PCI class guards the driver and the type; a request selector reading a PCI attribute with
    # no guard errs on the first network device the class lets through, never skips it
    got = select_request("w", sel(f'{A}.vendor == "10de"'), DRIVER, PCI + NETWORKS)
    assert "device lan:" in got.error
    fine = select_request("w", sel(PCI_CLASS, f'{A}.vendor == "10de"'), DRIVER, PCI + NETWORKS, "All")
    assert fine == Selection(GPUS, GPUS)  # && short-circuits: the class selector is evaluated first


# -- from the manifests beside the pod --------------------------------------------------------------------
def test_known_classes_are_the_deployed_ones() -> None:
    import yaml

    from tests.cli.vmsandbox_cmd import REPO

    deployed = {
        d["metadata"]["name"]: tuple(" ".join(s["cel"]["expression"].split()) for s in d["spec"]["selectors"])
        for d in yaml.safe_load_all((REPO / "deploy" / "dra" / "deviceclass.yaml").read_text())
    }
    assert deployed == {k: tuple(e.format(driver=DRIVER) for e in v) for k, v in KNOWN_CLASSES.items()}


def template(request: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t"},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }


CUSTOM = {
    "kind": "DeviceClass",
    "metadata": {"name": "fast-net"},
    "spec": {"selectors": [{"cel": {"expression": NETWORK_CLASS}}, {"cel": {"expression": f'{A}.kind == "macvlan"'}}]},
}


@pytest.mark.parametrize(
    ("request_", "docs", "want_devices", "want"),
    [
        ({"name": "net", "exactly": {"deviceClassName": "vmsandbox-network"}}, [], ("lan",), ""),
        (
            {
                "name": "net",
                "exactly": {
                    "deviceClassName": "vmsandbox-network",
                    "selectors": [{"cel": {"expression": f'{A}.subnet == "10.9.0.0/16"'}}],
                },
            },
            [],
            ("fast",),
            "",
        ),
        ({"name": "net", "exactly": {"deviceClassName": "fast-net"}}, [CUSTOM], ("fast",), ""),
        (
            {
                "name": "any",
                "firstAvailable": [
                    {
                        "name": "gpu",
                        "deviceClassName": "vmsandbox-pci",
                        "count": 2,
                        "selectors": [{"cel": {"expression": f'{A}.vendor == "10de"'}}],
                    }
                ],
            },
            [],
            GPUS[:2],
            "",
        ),
        ({"name": "all", "exactly": {"deviceClassName": "vmsandbox-pci", "allocationMode": "All"}}, [], ALL_PCI, ""),
        (
            {"name": "x", "exactly": {"deviceClassName": "unknown"}},
            [],
            (),
            "DeviceClass unknown is not in the manifest",
        ),
        (
            {
                "name": "net",
                "exactly": {
                    "deviceClassName": "vmsandbox-network",
                    "selectors": [{"cel": {"expression": f'{A}.nosuch == "x"'}}],
                },
            },
            [],
            (),
            "resourceClaims c request net: request selector 0 ",
        ),
    ],
)
def test_select_claims(request_: dict[str, Any], docs: list[Any], want_devices: tuple[str, ...], want: str) -> None:
    name = request_["name"] + ("/" + request_["firstAvailable"][0]["name"] if "firstAvailable" in request_ else "")
    cls = (
        request_["firstAvailable"][0]["deviceClassName"]
        if "firstAvailable" in request_
        else request_["exactly"]["deviceClassName"]
    )
    planned = PlannedRequest("c", "template t", name, cls, ())
    (got,) = select_claims([planned], [template(request_), *docs], "default", DRIVER, DEVICES)
    assert got.devices == want_devices
    assert want in (got.error or got.reason), got


def test_select_claims_refuses_a_bad_count() -> None:
    from vmsandbox.errors import InvalidArgument

    bad = {"name": "n", "exactly": {"deviceClassName": "vmsandbox-network", "count": 0}}
    with pytest.raises(InvalidArgument, match="count must be an integer from 1 to 32"):
        select_claims(
            [PlannedRequest("c", "template t", "n", "vmsandbox-network", ())],
            [template(bad)],
            "default",
            DRIVER,
            DEVICES,
        )


@pytest.mark.parametrize(
    ("expressions", "want"),
    [
        ((NETWORK_CLASS,), True),
        (("device.driver=='vmsandbox.dev'",), True),
        (('device.driver == "gpu.example.com"',), False),
        ((f'{A}.type == "network"',), False),
    ],
)
def test_names_driver(expressions: tuple[str, ...], want: bool) -> None:
    assert names_driver(sel(*expressions), DRIVER) is want


def test_class_selectors_from_the_manifest_win() -> None:
    mine = {"kind": "DeviceClass", "metadata": {"name": "vmsandbox-network"}, "spec": {"selectors": []}}
    assert class_selectors("vmsandbox-network", [mine], DRIVER) == ()
    assert class_selectors("vmsandbox-network", [], DRIVER) == (
        Selector("class vmsandbox-network selector 0", NETWORK_CLASS),
    )
    assert class_selectors("nope", [], DRIVER) is None
