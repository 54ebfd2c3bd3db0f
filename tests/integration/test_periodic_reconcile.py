"""While the shim serves, its periodic reconcile removes what a lost libvirt call left behind: a
domain of this state database that no sandbox row knows (a define whose RunPodSandbox never
recorded it) is torn down within a few intervals, and the pods that are whole are not touched."""

from __future__ import annotations

import re
import secrets
import time
import uuid
from pathlib import Path

import libvirt
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import LIBVIRT_URI, our_domains, pod, require_host, running_shim, state_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_orphaned_domain_is_removed_while_the_shim_serves(tmp_path: Path) -> None:
    require_host()
    with running_shim(tmp_path, extra_config={"reconcile_interval_s": 1}) as shim:
        sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=pod("whole")), timeout=300).pod_sandbox_id
        conn = libvirt.open(LIBVIRT_URI)
        try:
            xml = next(d for d in conn.listAllDomains(0) if sid[:32] in d.name()).XMLDesc(0)
            ghost = secrets.token_hex(32)
            orphan_xml = re.sub(r"<uuid>[^<]*</uuid>", f"<uuid>{uuid.uuid4()}</uuid>", xml.replace(sid, ghost))
            orphan_xml = orphan_xml.replace(sid[:32], ghost[:32])
            orphan = conn.defineXML(orphan_xml).name()  # defined, never started, no row: what a lost define leaves
            assert orphan in our_domains()
            deadline = time.monotonic() + 30
            while orphan in our_domains():
                assert time.monotonic() < deadline, "the periodic reconcile did not remove the orphaned domain"
                time.sleep(0.5)
        finally:
            conn.close()
        status = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30).status
        assert status.state == pb.SANDBOX_READY
        assert any(sid[:32] in name for name in our_domains())
        assert "the ledger has no row for it" in shim.log_text()


def test_the_start_up_reconcile_removes_a_leftover_shared_directory(tmp_path: Path) -> None:
    # what a shim killed during RunPodSandbox leaves: a sandbox directory no row knows; with no
    # periodic reconcile, only the start-up one can remove it
    require_host()
    leftover = state_dir(tmp_path) / "sandboxes" / secrets.token_hex(32)  # where the shim's state will be
    (leftover / "shared" / "containers").mkdir(parents=True)
    (leftover / "images").mkdir()
    with running_shim(tmp_path, extra_config={"reconcile_interval_s": 0}, pull_busybox=False):
        assert not leftover.exists()
