"""Generate the Python gRPC stubs from proto/*.proto, reproducibly.

    python proto/generate.py            # writes duet/v1/*_pb2*.py and duet/internal/v1/*_pb2*.py
    python proto/generate.py --out DIR  # writes under DIR instead (the staleness test compares the two)

The output depends only on the .proto files and the pinned grpcio-tools version (pyproject.toml), so
tests/test_proto.py regenerates into a temporary dir and fails when a checked-in stub differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on every .proto; returns the files written, relative to out_dir."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto shipped with grpcio-tools
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in files:
        package = Path(proto).parent  # e.g. duet/v1: each level must be a regular package
        for level in [package, *package.parents][:-1]:
            (out_dir / level / "__init__.py").touch()
        stem = Path(proto).stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(Path(proto).parent / f"{stem}{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
