"""Regenerate the checked-in Python code for protos/dsmesh/v1/*.proto.

    python protos/generate.py            # writes dsmesh/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi

Uses grpcio-tools (pinned in pyproject.toml so the output is stable) and the google.api
annotations shipped by googleapis-common-protos. tests/test_protos.py fails when the
checked-in code is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"


def _include_dirs() -> list[Path]:
    import google.api.annotations_pb2 as annotations
    import grpc_tools

    googleapis = Path(annotations.__file__).resolve().parents[2]  # .../site-packages
    return [PROTO_ROOT, Path(grpc_tools.__file__).parent / "_proto", googleapis]


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "dsmesh" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into ``out_dir`` (package folders created); returns new files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc"]
    args += [f"-I{d}" for d in _include_dirs()]
    args += [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_dir / "dsmesh" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    files = generate(ROOT)
    init = ROOT / "dsmesh" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC code for package dsmesh.v1."""\n')
    for f in files:
        print(f"wrote {f.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
