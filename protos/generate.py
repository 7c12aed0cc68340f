"""Generate the Python gRPC code for every .proto under protos/ into an output root.

Generated code is never committed: `make` runs this at install time into the ignored
`splittts/` folder at the repository root, so `from splittts.tts.v1 import tts_pb2` works.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate(out_root: Path) -> list[Path]:
    """Compile all protos into `out_root`; returns the generated files."""
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    out_root.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
    ]
    if protoc.main(args + [str(p) for p in protos]) != 0:
        raise RuntimeError("protoc failed")
    # Package markers so the generated tree imports as regular packages.
    for proto in protos:
        rel = proto.parent.relative_to(PROTO_ROOT)
        for depth in range(1, len(rel.parts) + 1):
            (out_root / Path(*rel.parts[:depth]) / "__init__.py").touch()
    return sorted(p for p in out_root.rglob("*") if p.is_file())


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent
    generate(root)
