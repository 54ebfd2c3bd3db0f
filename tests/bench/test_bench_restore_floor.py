"""The restore-floor benchmark runs libvirt's own QEMU command line bare: ``bare_argv`` puts the
monitor, the agent channel, the console and the 9p shares on paths of its own and keeps the rest,
for the command lines libvirt 9.0 (QEMU 7.2) and libvirt 11.3 (QEMU 10.0) write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.restore_floor import bare_argv

_SECRET = (
    '{"qom-type":"secret","id":"masterKey0","format":"raw","file":"/var/lib/libvirt/qemu/domain-1-x/master-key.aes"}'
)
_COMMON = [
    "-chardev",
    "socket,id=charmonitor,fd=31,server=on,wait=off",
    "-mon",
    "chardev=charmonitor,id=monitor,mode=control",
    "-fsdev",
    "local,security_model=mapped,multidevs=remap,fmode=0600,dmode=0700,id=fsdev-fs0,path=/var/lib/vmsandbox/s/shared",
    "-chardev",
    "file,id=charserial0,path=/var/log/vmsandbox/console.log,append=on",
    "-chardev",
    "socket,id=charchannel0,fd=33,server=on,wait=off",
]
LIBVIRT_9 = [
    "/usr/bin/qemu-system-x86_64",
    "-object",
    _SECRET,
    "-machine",
    "pc-q35-7.2,usb=off,dump-guest-core=off,memory-backend=pc.ram",
    "-object",
    '{"qom-type":"memory-backend-file","id":"pc.ram","mem-path":"/dev/hugepages/libvirt/qemu/1-x","prealloc":true,"size":268435456}',
    *_COMMON,
    "-incoming",
    "defer",
]
LIBVIRT_11 = [  # its console file comes as a descriptor too (an -add-fd set)
    "/usr/bin/qemu-system-x86_64",
    "-object",
    _SECRET,
    "-machine",
    "pc-q35-10.0,usb=off,dump-guest-core=off,memory-backend=pc.ram,acpi=on",
    "-object",
    '{"qom-type":"thread-context","id":"tc-pc.ram","node-affinity":[0]}',
    "-object",
    '{"qom-type":"memory-backend-file","id":"pc.ram","mem-path":"/dev/hugepages/libvirt/qemu/1-x",'
    '"x-use-canonical-path-for-ramblock-id":false,"prealloc":true,"size":268435456,"host-nodes":[0],'
    '"policy":"bind","prealloc-context":"tc-pc.ram"}',
    *_COMMON[:6],
    "-add-fd",
    "set=0,fd=22,opaque=serial0-source",
    "-chardev",
    "file,id=charserial0,path=/dev/fdset/0,append=on",
    *_COMMON[8:],
    "-incoming",
    "defer",
]


@pytest.mark.parametrize("libvirt_argv", [LIBVIRT_9, LIBVIRT_11], ids=["libvirt-9.0", "libvirt-11.3"])
def test_bare_argv_runs_on_paths_of_its_own(libvirt_argv: list[str], tmp_path: Path) -> None:
    argv = bare_argv(libvirt_argv, tmp_path)
    joined = " ".join(argv)
    assert "fd=" not in joined and "-add-fd" not in argv and "masterKey0" not in joined
    assert f"socket,id=charmonitor,server=on,wait=off,path={tmp_path}/charmonitor.sock" in argv
    assert f"socket,id=charchannel0,server=on,wait=off,path={tmp_path}/charchannel0.sock" in argv
    assert f"file,id=charserial0,path={tmp_path}/console.log,append=on" in argv
    assert any(a.startswith("local,") and a.endswith(f"path={tmp_path}/share0") for a in argv)
    assert (tmp_path / "share0" / "containers").is_dir()
    backends = [json.loads(a) for a in argv if a.startswith("{") and "memory-backend-file" in a]
    assert [b["mem-path"] for b in backends] == ["/dev/hugepages"]  # its own file, not libvirt's directory
    assert argv[-2:] == ["-incoming", "defer"]
    if libvirt_argv is LIBVIRT_11:  # the prealloc thread context stays: the backend names it
        assert any('"thread-context"' in a for a in argv) and backends[0]["prealloc-context"] == "tc-pc.ram"
