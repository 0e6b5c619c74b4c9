"""The checked-in gRPC stubs are exactly what proto/generate.py makes from the .proto files."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_stubs_are_fresh(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(tmp_path)],
        check=True, capture_output=True, text=True,
    )
    generated = [Path(line) for line in out.stdout.split()]
    assert {p.name for p in generated} >= {"generation_pb2.py", "generation_pb2_grpc.py", "workers_pb2.py"}
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (REPO / p).read_bytes()]
    assert not stale, f"stale stubs {stale}: run `python proto/generate.py` and commit the result"


def test_every_proto_has_stubs():
    protos = sorted((REPO / "proto").rglob("*.proto"))
    assert len(protos) == 2
    for proto in protos:
        rel = proto.relative_to(REPO / "proto")
        assert (REPO / rel.parent / f"{rel.stem}_pb2.py").exists(), rel


def test_public_api_shape():
    from duet.v1 import generation_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert {m.name for m in service.methods} == {"Generate", "Abort", "ExplainRoute"}
    assert service.methods_by_name["Generate"].server_streaming
    # real-valued sampling parameters are doubles: a float32 would change what a value means
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert fields[name].type == fields[name].TYPE_DOUBLE, name
