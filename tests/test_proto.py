"""The checked-in gRPC stubs are exactly what proto/generate.py makes from the .proto files; `buf lint` is clean."""

import os
import re
import shutil
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


def buf() -> str:
    """The buf CLI: PyPI's buf-bin (the `test` extra) puts it next to this Python."""
    found = shutil.which("buf", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "buf is missing: `pip install '.[test]'` installs it (buf-bin)"
    return found


def test_buf_lint_is_clean():
    """buf's STANDARD rules, less the exceptions /buf.yaml lists (each explained in its .proto file's header)."""
    out = subprocess.run([buf(), "lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    config = (REPO / "buf.yaml").read_text()
    for rule in re.findall(r"^    ([A-Z_]+):", config, flags=re.M):  # every exception is explained in a .proto
        assert any(rule in p.read_text() for p in (REPO / "proto").rglob("*.proto")), rule


def test_buf_lint_finds_what_it_should(tmp_path):
    """The same configuration refuses a field that breaks the style (so the clean run above means something)."""
    module = tmp_path / "proto" / "duet" / "v1"
    module.mkdir(parents=True)
    (module / "bad.proto").write_text('syntax = "proto3";\npackage duet.v1;\nmessage Bad { int32 badName = 1; }\n')
    config = (REPO / "buf.yaml").read_text()
    (tmp_path / "buf.yaml").write_text(config)
    out = subprocess.run([buf(), "lint"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and 'Field name "badName" should be lower_snake_case' in out.stdout, out.stdout
