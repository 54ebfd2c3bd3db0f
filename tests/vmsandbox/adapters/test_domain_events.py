"""vmsandbox.adapters.domain_events against libvirt's test driver: a guest that stops reaches the callback."""

from __future__ import annotations

import threading
import uuid

import libvirt
import pytest

from vmsandbox.adapters.domain_events import DomainEvents, describe

XML = """<domain type='test'><name>{name}</name><uuid>{uuid}</uuid><memory>65536</memory><vcpu>1</vcpu>
<os><type>hvm</type></os></domain>"""


@pytest.mark.parametrize(
    ("event", "detail", "expected"),
    [
        (libvirt.VIR_DOMAIN_EVENT_STOPPED, libvirt.VIR_DOMAIN_EVENT_STOPPED_DESTROYED, "the guest was destroyed"),
        (libvirt.VIR_DOMAIN_EVENT_STOPPED, libvirt.VIR_DOMAIN_EVENT_STOPPED_FAILED, "QEMU failed"),
        (libvirt.VIR_DOMAIN_EVENT_STOPPED, libvirt.VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN, "the guest shut down"),
        (libvirt.VIR_DOMAIN_EVENT_CRASHED, libvirt.VIR_DOMAIN_EVENT_CRASHED_PANICKED, "the guest kernel panicked"),
        (libvirt.VIR_DOMAIN_EVENT_STARTED, 0, None),
        (libvirt.VIR_DOMAIN_EVENT_SUSPENDED, 0, None),
        (libvirt.VIR_DOMAIN_EVENT_STOPPED, 99, "the guest stopped"),
    ],
)
def test_describe(event: int, detail: int, expected: str | None) -> None:
    assert describe(event, detail) == expected


def test_a_destroyed_guest_of_ours_is_reported_and_others_are_not() -> None:
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def on_stop(name: str, why: str) -> None:
        seen.append((name, why))
        done.set()

    events = DomainEvents("test:///default", on_stop)
    events.start()
    conn = libvirt.open("test:///default")
    try:
        ours, other = f"vmsandbox-{uuid.uuid4().hex[:12]}", f"other-{uuid.uuid4().hex[:8]}"
        doms = [conn.createXML(XML.format(name=n, uuid=uuid.uuid4()), 0) for n in (other, ours)]
        for d in doms:
            d.destroy()
        assert done.wait(10), "no stop event reached the callback"
        assert seen == [(ours, "the guest was destroyed")]
    finally:
        events.close()
        conn.close()
