"""Start a local docker-registry on 127.0.0.1 and push a small busybox image built from the host's
busybox-static, for scripts/demo.sh. Prints {"image": REF, "registry_pid": PID} as JSON; the
registry keeps running (the caller stops it)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests import interrupts
from tests.registry_kit import Layout, Registry, busybox_entries, push


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: demo_image.py DIR", file=sys.stderr)
        return 2
    registry = Registry(Path(sys.argv[1])).start()
    assert registry.process is not None
    try:
        with tempfile.TemporaryDirectory(prefix="vmsandbox-demo-image-") as tmp:
            layout = Layout(Path(tmp))
            applets = ("sh", "echo", "cat", "id", "uname", "sleep", "hostname")
            layout.tag("demo", layout.image([layout.layer(busybox_entries(applets))], cmd=("sh",)))
            ref = f"{registry.host}/demo/busybox:1"
            push(layout, "demo", ref)
    except BaseException:  # failed or interrupted: the caller is never told of the registry
        registry.stop()
        raise
    print(json.dumps({"image": ref, "registry_pid": registry.process.pid}))
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
