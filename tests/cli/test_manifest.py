"""``vmsandbox.manifest``: a manifest to the declaration a KEP-4112 kubelet would send (pure, in-process)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.cli.vmsandbox_cmd import MANIFESTS
from vmsandbox.errors import InvalidArgument
from vmsandbox.manifest import pod_from_manifest, select_workload, workloads
from vmsandbox.record_docs import declaration_doc


def pod(containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": containers, **spec}}


@dataclass(frozen=True)
class Case:
    id: str
    doc: dict[str, Any]
    requests: dict[str, str]  # of the first app container, after defaulting
    limits: dict[str, str]


CASES = [
    Case("limits-only-default-requests", pod([{"name": "a", "resources": {"limits": {"cpu": 1, "memory": "1Gi"}}}]),
         {"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"}),
    Case("requests-only", pod([{"name": "a", "resources": {"requests": {"cpu": "250m"}}}]), {"cpu": "250m"}, {}),
    Case("partial-defaulting",
         pod([{"name": "a", "resources": {"requests": {"cpu": "100m"}, "limits": {"cpu": "1", "memory": "64Mi"}}}]),
         {"cpu": "100m", "memory": "64Mi"}, {"cpu": "1", "memory": "64Mi"}),
    Case("yaml-numbers-are-quantities", pod([{"name": "a", "resources": {"limits": {"cpu": 0.5, "memory": 1000000}}}]),
         {"cpu": "500m", "memory": "1M"}, {"cpu": "500m", "memory": "1M"}),
    Case("canonical-forms", pod([{"name": "a", "resources": {"limits": {"cpu": "1000m", "memory": "1024Mi"}}}]),
         {"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"}),
    Case("extended-kept", pod([{"name": "a", "resources": {"limits": {"example.com/nic": 2, "memory": "1Gi"}}}]),
         {"example.com/nic": "2", "memory": "1Gi"}, {"example.com/nic": "2", "memory": "1Gi"}),
    Case("no-resources", pod([{"name": "a"}]), {}, {}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_requests_after_defaulting(case: Case) -> None:
    decl = pod_from_manifest(case.doc).declaration
    first = declaration_doc(decl)["containers"][0]
    assert (first["requests"], first["limits"]) == (case.requests, case.limits)
    assert first["devices"] == [] and first["cdi_devices"] == []


def test_init_containers_and_sidecars_in_order() -> None:
    doc = yaml.safe_load((MANIFESTS / "init-hugepages-pod.yaml").read_text())
    m = pod_from_manifest(doc)
    assert [c.name for c in m.declaration.init_containers] == ["setup", "log-shipper"]
    assert [c.name for c in m.declaration.containers] == ["forwarder"]
    assert m.sidecars == ("log-shipper",)
    assert (m.pod, m.kind) == ("net/dpdk", "Pod")
    mounts = declaration_doc(m.declaration)["containers"][0]["mounts"]
    assert mounts == [
        {
            "container_path": "/hugepages",
            "host_path": "",
            "readonly": False,
            "recursive_read_only": False,
            "selinux_relabel": False,
            "propagation": 0,
        }
    ]
    assert any("host paths" in n for n in m.notes)


@pytest.mark.parametrize(
    "kind,api,template_path",
    [
        ("Deployment", "apps/v1", ("spec", "template")),
        ("StatefulSet", "apps/v1", ("spec", "template")),
        ("DaemonSet", "apps/v1", ("spec", "template")),
        ("Job", "batch/v1", ("spec", "template")),
        ("CronJob", "batch/v1", ("spec", "jobTemplate", "spec", "template")),
        ("PodTemplate", "v1", ("template",)),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_workload_templates(kind: str, api: str, template_path: tuple[str, ...]) -> None:
    template: dict[str, Any] = {
        "metadata": {"labels": {"app": "x"}, "annotations": {"note": "y"}},
        "spec": {"runtimeClassName": "vmsandbox", "containers": [{"name": "c", "resources": {"limits": {"cpu": 2}}}]},
    }
    doc: dict[str, Any] = template
    for key in reversed(template_path):
        doc = {key: doc}
    doc = {"apiVersion": api, "kind": kind, "metadata": {"name": "w", "namespace": "ns"}, **doc}
    m = pod_from_manifest(doc)
    assert (m.kind, m.pod, m.runtime_class) == (kind, "ns/w", "vmsandbox")
    assert m.labels == (("app", "x"),) and m.annotations == (("note", "y"),)
    assert m.declaration.containers[0].resources.requests.as_strings() == {"cpu": "2"}


@pytest.mark.parametrize(
    "doc,message",
    [
        pytest.param(pod([{"name": "a", "resources": {"requests": {"cpu": 2}, "limits": {"cpu": 1}}}]),
                     "must be less than or equal to cpu limit of 1", id="request-over-limit"),
        pytest.param(pod([{"name": "a", "resources": {"requests": {"hugepages-2Mi": "2Mi", "memory": "1Mi"},
                                                       "limits": {"hugepages-2Mi": "4Mi", "memory": "1Mi"}}}]),
                     "must be equal to hugepages-2Mi limit of 4Mi", id="hugepages-overcommit"),
        pytest.param(pod([{"name": "a", "resources": {"limits": {"hugepages-1Mi": "1Mi"}}}]),
                     "unsupported hugepage resource", id="unknown-page-size"),
        pytest.param(pod([{"name": "a", "resources": {"limits": {"cpu": True}}}]), "a quantity must be", id="bool"),
        pytest.param(pod([{"name": "a", "resources": {"limit": {}}}]), "resources.limit: unknown field", id="typo"),
        pytest.param(pod([{"name": "a", "volumeMounts": [{"name": "v"}]}]), "volumeMounts[0].mountPath", id="mount"),
        pytest.param(pod([{"image": "x"}]), "spec.containers[0].name: must be a non-empty string", id="no-name"),
        pytest.param({"kind": "Pod", "apiVersion": "v1", "spec": {}}, "metadata: missing", id="no-metadata"),
        pytest.param({"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p"}}, "spec: missing", id="no-spec"),
    ],
)  # fmt: skip
def test_invalid(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        pod_from_manifest(doc)
    assert message in str(err.value)


def test_select_workload_skips_other_kinds() -> None:
    docs = list(yaml.safe_load_all((MANIFESTS / "deployment.yaml").read_text()))
    assert select_workload(docs)["kind"] == "Deployment"
    with pytest.raises(InvalidArgument, match="out of range"):
        select_workload(docs, 3)


LIST_CASES = [
    pytest.param([{"apiVersion": "v1", "kind": "List", "items": [pod([{"name": "a"}])]}], ["p"], id="list-of-one"),
    pytest.param(
        [
            {"kind": "ConfigMap", "metadata": {"name": "c"}},
            {"apiVersion": "v1", "kind": "PodList", "items": [pod([{"name": "a"}]), {"kind": "Service"}]},
            {**pod([{"name": "b"}]), "metadata": {"name": "q"}},
        ],
        ["p", "q"],
        id="typed-list-beside-documents",
    ),
    pytest.param(
        [{"kind": "List", "items": [{"kind": "List", "items": [pod([{"name": "a"}])]}]}], ["p"], id="nested-lists"
    ),
    pytest.param([{"kind": "List", "items": []}], [], id="empty-list"),
]


@pytest.mark.parametrize(("docs", "names"), LIST_CASES)
def test_lists_are_unwrapped(docs: list[Any], names: list[str]) -> None:
    assert [d["metadata"]["name"] for d in workloads(docs)] == names


def test_list_items_must_be_a_list() -> None:
    with pytest.raises(InvalidArgument) as exc:
        workloads([{"kind": "List", "items": {"a": 1}}])
    assert str(exc.value) == "kind List: items must be a list, got dict"


def test_empty_list_names_what_it_found() -> None:
    with pytest.raises(InvalidArgument) as exc:
        select_workload([{"kind": "List", "items": [{"kind": "Service"}]}])
    assert str(exc.value).startswith("no pod in the manifest (found kind Service)")


@pytest.mark.parametrize(
    ("overhead", "cpu", "memory"),
    [
        pytest.param(None, 0, 0, id="none"),
        pytest.param({"cpu": "250m", "memory": "120Mi"}, 250, 120 << 20, id="both"),
        pytest.param({"memory": 1000000}, 0, 1_000_000, id="memory-number"),
    ],
)
def test_runtimeclass_overhead_is_read(overhead: dict[str, Any] | None, cpu: int, memory: int) -> None:
    m = pod_from_manifest(pod([{"name": "a"}], **({"overhead": overhead} if overhead else {})))
    assert (m.overhead_cpu_millis, m.overhead_memory_bytes) == (cpu, memory)
