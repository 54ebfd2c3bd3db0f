"""The envelope rule (vmsandbox.lifecycle.check_fits_beside), the one place CreateContainer,
UpdateContainerResources and NRI plugins' adjustments of both are held to the VM: who counts
beside a container, table by table."""

from __future__ import annotations

import pytest

from vmsandbox.admission import Usage
from vmsandbox.errors import VmSandboxError
from vmsandbox.lifecycle import Sibling, check_fits_beside
from vmsandbox.profile import SIDECARS_ANNOTATION
from vmsandbox.sizing import LinuxResources, PodDemand

MI = 1 << 20
DEMAND = PodDemand(cpu_millis=2000, memory_bytes=256 * MI, mode="linux-resources")


def mem(mib: int) -> LinuxResources:
    return LinuxResources(memory_limit_bytes=mib * MI)


@pytest.mark.parametrize(
    ("siblings", "init_order", "sidecars", "fits"),
    [
        pytest.param([Sibling("a", 0, mem(100), False)], (), "", True, id="one-live-sibling-fits"),
        pytest.param([Sibling("a", 0, mem(200), False)], (), "", False, id="one-live-sibling-too-big"),
        pytest.param([Sibling("a", 0, mem(200), True)], (), "", True, id="an-exited-sibling-does-not-count"),
        pytest.param(
            [Sibling("a", 0, mem(200), False), Sibling("a", 1, mem(100), False)],
            (),
            "",
            True,
            id="only-the-latest-attempt-counts",
        ),
        pytest.param([Sibling("init", 0, mem(200), False)], ("init",), "", True, id="a-plain-init-container-has-ended"),
        pytest.param(
            [Sibling("proxy", 0, mem(200), False)], ("proxy",), "proxy", False, id="a-sidecar-stays-beside-the-app"
        ),
        pytest.param(
            [Sibling("app", 0, mem(10), False), Sibling("app", 0, mem(10), False)], (), "", True, id="itself-never"
        ),
    ],
)
def test_who_counts_beside_an_app_container(
    siblings: list[Sibling], init_order: tuple[str, ...], sidecars: str, fits: bool
) -> None:
    annotations = {SIDECARS_ANNOTATION: sidecars} if sidecars else {}

    def check() -> None:
        check_fits_beside(
            DEMAND,
            "app",
            Usage(memory_bytes=100 * MI),
            siblings,
            init_order=init_order,
            annotations=annotations,
            who='container "app"',
        )

    if fits:
        check()
    else:
        with pytest.raises(VmSandboxError, match='container "app"'):
            check()
