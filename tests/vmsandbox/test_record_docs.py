"""Tests of vmsandbox.record_docs: the JSON documents the state database keeps round-trip exactly."""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.quantity import format_quantity
from vmsandbox.record_docs import (
    declaration_doc,
    declaration_from_doc,
    demand_doc,
    demand_from_doc,
    resources_doc,
    resources_from_doc,
    shape_doc,
    shape_from_doc,
)
from vmsandbox.resources import (
    CdiDevice,
    ContainerDeclaration,
    ContainerResources,
    Device,
    Mount,
    PodDeclaration,
    ResourceList,
)
from vmsandbox.sizing import PodDemand, VmShape

MI, GI = 1024**2, 1024**3


def via_json(doc: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(json.dumps(doc, sort_keys=True))
    return result


DECLARATION = PodDeclaration(
    init_containers=(
        ContainerDeclaration("init", ContainerResources(limits=ResourceList.parse({"cpu": "2"}, where="x"))),
    ),
    containers=(
        ContainerDeclaration(
            "app",
            ContainerResources(
                requests=ResourceList.parse({"memory": "1.5Gi", "cpu": "0.5"}, where="x"),
                limits=ResourceList.parse({"memory": "2Gi", "hugepages-2Mi": "4Mi"}, where="x"),
                mounts=frozenset({Mount("/data", "/srv/data", readonly=True, propagation=2), Mount("/a")}),
                devices=frozenset({Device("/dev/fuse", "/dev/fuse", "rwm")}),
                cdi_devices=frozenset({CdiDevice("vendor.com/gpu=1"), CdiDevice("vendor.com/gpu=0")}),
            ),
        ),
    ),
)
EMPTY: dict[str, object] = {"requests": {}, "limits": {}, "mounts": [], "devices": [], "cdi_devices": []}
DECLARATION_DOC = {
    "init_containers": [{"name": "init", **EMPTY, "limits": {"cpu": "2"}}],
    "containers": [
        {
            "name": "app",
            "requests": {"cpu": "500m", "memory": "1536Mi"},
            "limits": {"hugepages-2Mi": "4Mi", "memory": "2Gi"},
            "mounts": [
                {
                    "container_path": "/a",
                    "host_path": "",
                    "readonly": False,
                    "recursive_read_only": False,
                    "selinux_relabel": False,
                    "propagation": 0,
                },
                {
                    "container_path": "/data",
                    "host_path": "/srv/data",
                    "readonly": True,
                    "recursive_read_only": False,
                    "selinux_relabel": False,
                    "propagation": 2,
                },
            ],
            "devices": [{"container_path": "/dev/fuse", "host_path": "/dev/fuse", "permissions": "rwm"}],
            "cdi_devices": ["vendor.com/gpu=0", "vendor.com/gpu=1"],
        }
    ],
}
SHAPE = VmShape(
    vcpus=2,
    memory_bytes=512 * MI,
    backing_page_size=2 * MI,
    guest_hugepages=((2 * MI, 2),),
    cpu_policy="exclusive",
    demand=PodDemand(
        1500,
        256 * MI,
        hugepages=((2 * MI, 4 * MI),),
        ephemeral_storage_bytes=GI,
        extended=(("vendor.com/gpu", 1),),
        mode="declared",
    ),
)
SHAPE_DOC = {
    "vcpus": 2,
    "memory_bytes": 512 * MI,
    "backing_page_size": 2 * MI,
    "guest_hugepages": [[2 * MI, 2]],
    "cpu_policy": "exclusive",
    "demand": {
        "cpu_millis": 1500,
        "memory_bytes": 256 * MI,
        "hugepages": [[2 * MI, 4 * MI]],
        "ephemeral_storage_bytes": GI,
        "extended": [["vendor.com/gpu", 1]],
        "mode": "declared",
    },
}


def test_declaration_doc_is_canonical_and_sorted() -> None:
    assert declaration_doc(DECLARATION) == DECLARATION_DOC
    assert declaration_from_doc(via_json(DECLARATION_DOC)) == DECLARATION


def test_shape_doc() -> None:
    assert shape_doc(SHAPE) == SHAPE_DOC
    assert shape_from_doc(via_json(SHAPE_DOC)) == SHAPE


def test_older_documents_take_defaults() -> None:
    assert declaration_from_doc({"containers": [{"name": "app"}]}) == PodDeclaration(
        containers=(ContainerDeclaration("app"),)
    )
    assert demand_from_doc({"cpu_millis": 1, "memory_bytes": 2}) == PodDemand(1, 2)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        pytest.param(
            {"limits": {"cpu": "lots"}},
            'container "app": limits.cpu: invalid quantity "lots": no digits; '
            "expected [+-]<digits>[.<digits>] and an optional suffix: n u m k M G T P E, Ki Mi Gi Ti Pi Ei, "
            'or an exponent such as "e3" (examples: "500m", "1.5", "2Gi", "1e3")',
            id="bad-quantity",
        ),
        pytest.param(
            {"requests": {"hugepages-4Mi": "4Mi"}},
            'container "app": requests: unsupported hugepage resource '
            "'hugepages-4Mi' (supported: hugepages-2Mi, hugepages-1Gi)",
            id="bad-page-size",
        ),
    ],
)
def test_corrupt_resources_are_refused(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        resources_from_doc(doc, 'container "app"')
    assert str(exc.value) == message


# -- properties ---------------------------------------------------------------------------------
QUANTITIES = st.builds(
    lambda n, den, fmt: format_quantity(Fraction(n, den), fmt),
    st.integers(0, 10**12),
    st.sampled_from([1, 1000, 10**9]),
    st.sampled_from(["DecimalSI", "BinarySI", "DecimalExponent"]),
) | st.sampled_from(["1.5Gi", "0.5", "1e3", "129M", "100m", "1.953125Ki", "0.000000001"])
RESOURCE_NAMES = st.sampled_from(
    ["cpu", "memory", "ephemeral-storage", "hugepages-2Mi", "hugepages-1Gi", "vendor.com/gpu", "example.org/nic"]
)
PATHS = st.text(alphabet="abc/-_.é \"'<", min_size=0, max_size=12)
MOUNTS = st.builds(Mount, PATHS, PATHS, st.booleans(), st.booleans(), st.integers(0, 2))
DEVICES = st.builds(Device, PATHS, PATHS, st.sampled_from(["", "r", "rw", "rwm"]))
RESOURCES = st.builds(
    ContainerResources,
    requests=st.dictionaries(RESOURCE_NAMES, QUANTITIES).map(lambda d: ResourceList.parse(d, where="x")),
    limits=st.dictionaries(RESOURCE_NAMES, QUANTITIES).map(lambda d: ResourceList.parse(d, where="x")),
    mounts=st.frozensets(MOUNTS, max_size=3),
    devices=st.frozensets(DEVICES, max_size=2),
    cdi_devices=st.frozensets(st.builds(CdiDevice, st.text(min_size=1, max_size=10)), max_size=2),
)
NAMES = st.text(alphabet="abcxyz-0123456789", min_size=1, max_size=8)


@st.composite
def declarations(draw: st.DrawFn) -> PodDeclaration:
    names = draw(st.lists(NAMES, min_size=1, max_size=5, unique=True))
    n_init = draw(st.integers(0, len(names) - 1))
    decls = [ContainerDeclaration(n, draw(RESOURCES)) for n in names]
    return PodDeclaration(init_containers=tuple(decls[:n_init]), containers=tuple(decls[n_init:]))


@settings(max_examples=50, deadline=None)
@given(declarations())
def test_declaration_round_trips(decl: PodDeclaration) -> None:
    doc = via_json(declaration_doc(decl))
    back = declaration_from_doc(doc)
    assert back == decl
    # and the stored form is a fixed point: storing what was read back stores the same values
    assert declaration_from_doc(via_json(declaration_doc(back))) == decl


PAGE_SIZES = st.sampled_from([4096, 2 * MI, GI])
DEMANDS = st.builds(
    PodDemand,
    cpu_millis=st.integers(0, 10**9),
    memory_bytes=st.integers(0, 2**50),
    hugepages=st.lists(st.tuples(st.sampled_from([2 * MI, GI]), st.integers(0, 2**40)), max_size=2).map(
        lambda x: tuple(sorted(x))
    ),
    ephemeral_storage_bytes=st.integers(0, 2**50),
    extended=st.lists(st.tuples(st.sampled_from(["a.io/x", "b.io/y"]), st.integers(1, 8)), max_size=2).map(tuple),
    mode=st.sampled_from(["declared", "linux-resources", "annotations", "defaults"]),
)
SHAPES = st.builds(
    VmShape,
    vcpus=st.integers(1, 1024),
    memory_bytes=st.integers(1, 2**50),
    backing_page_size=PAGE_SIZES,
    guest_hugepages=st.lists(st.tuples(st.sampled_from([2 * MI, GI]), st.integers(0, 4096)), max_size=2).map(tuple),
    cpu_policy=st.sampled_from(["exclusive", "shared"]),
    demand=DEMANDS,
)


@settings(max_examples=100, deadline=None)
@given(SHAPES)
def test_shape_round_trips(shape: VmShape) -> None:
    assert shape_from_doc(via_json(shape_doc(shape))) == shape
    assert demand_from_doc(via_json(demand_doc(shape.demand))) == shape.demand


def test_an_image_volumes_mount_round_trips_and_other_mounts_documents_stay_as_they_were() -> None:
    image = Mount("/img", readonly=True, image="sha256:" + "ab" * 32, image_sub_path="etc/x")
    res = ContainerResources(mounts=frozenset({image, Mount("/a", "/h")}))
    doc = via_json(resources_doc(res))
    assert resources_from_doc(doc, "x") == res
    assert [sorted(m) for m in doc["mounts"]] == [
        ["container_path", "host_path", "propagation", "readonly", "recursive_read_only", "selinux_relabel"],
        [
            "container_path",
            "host_path",
            "image",
            "image_sub_path",
            "propagation",
            "readonly",
            "recursive_read_only",
            "selinux_relabel",
        ],
    ]
