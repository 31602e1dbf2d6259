"""The committed gRPC code in collector/api is what `make proto` generates from proto/ today: the pinned
grpcio-tools (pyproject's `test` extra) regenerates it into a temporary folder, and every file must be
the same byte for byte, so an edit to the .proto without `make proto` fails here."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "collector/api/v1/fidelity.proto"
GENERATED = ("fidelity_pb2.py", "fidelity_pb2.pyi", "fidelity_pb2_grpc.py")


def test_the_committed_grpc_code_is_generated_from_the_proto(tmp_path):
    # the Makefile's `proto` target with its output in tmp_path; grpc_tools' bundled well-known types
    # on the include path, as `python -m grpc_tools.protoc` puts them
    include = Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "proto" / PROTO)]) == 0
    stale = [name for name in GENERATED
             if (tmp_path / PROTO).with_name(name).read_bytes() != (ROOT / PROTO).with_name(name).read_bytes()]
    assert not stale, f"collector/api/v1: {stale} differ from what proto/ generates: run `make proto`"
