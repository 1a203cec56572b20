"""The generated protos/*_pb2*.py must match their .proto files (`make protos` regenerates)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    protos = sorted((ROOT / "protos").glob("*.proto"))
    assert protos
    out = f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-Iferry/protos=protos",
        *out,
        *[f"protos/{p.name}" for p in protos],
    ]
    subprocess.run(cmd, cwd=ROOT, check=True)
    for fresh in sorted((tmp_path / "ferry" / "protos").glob("*_pb2*.py*")):
        committed = ROOT / "protos" / fresh.name
        assert committed.exists(), f"{committed.name} is missing: run `make protos`"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run `make protos`"
        )
