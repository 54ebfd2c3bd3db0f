#!/usr/bin/env python3
"""Print the wire contract of a cri-api ``api.proto`` as a table, one line per fact.

    scripts/cri-api-table.py PATH/TO/upstream/api.proto > tests/fixtures/cri-api/runtime-v1.tsv

Lines are tab-separated: ``field MESSAGE NAME NUMBER TYPE LABEL``, ``enum ENUM NAME NUMBER`` and
``rpc SERVICE NAME INPUT OUTPUT STREAMING``. tests/gen/test_proto_contract.py compares our
proto/ against the committed table, so a difference from upstream is a failing test. The table
holds names, numbers and types only: facts of the wire format, not upstream's text.
Needs grpcio-tools (the project's .venv has it).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

_TYPES = {v: k[len("TYPE_") :].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}
_LABELS = {v: k[len("LABEL_") :].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Label.items()}


def table(proto: Path) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{proto.parent}",
                f"--descriptor_set_out={out}",
                proto.name,
            ],
            check=True,
        )
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    lines: list[str] = []
    for f in files.file:

        def walk(
            prefix: str, messages: list[descriptor_pb2.DescriptorProto], enums: list[descriptor_pb2.EnumDescriptorProto]
        ) -> None:
            for e in enums:
                lines.extend(f"enum\t{prefix}{e.name}\t{v.name}\t{v.number}" for v in e.value)
            for m in messages:
                for fd in m.field:
                    kind = fd.type_name.lstrip(".") if fd.type_name else _TYPES[fd.type]
                    label = "proto3-optional" if fd.proto3_optional else _LABELS[fd.label]
                    lines.append(f"field\t{prefix}{m.name}\t{fd.name}\t{fd.number}\t{kind}\t{label}")
                walk(f"{prefix}{m.name}.", list(m.nested_type), list(m.enum_type))

        walk("", list(f.message_type), list(f.enum_type))
        for s in f.service:
            for md in s.method:
                stream = "server-stream" if md.server_streaming else "unary"
                lines.append(
                    f"rpc\t{s.name}\t{md.name}\t{md.input_type.lstrip('.')}\t{md.output_type.lstrip('.')}\t{stream}"
                )
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(table(Path(sys.argv[1]))))
