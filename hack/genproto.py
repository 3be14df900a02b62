"""Regenerate the gRPC code under kxpu/api from its .proto files.

`python hack/genproto.py` rewrites the committed files; `--check` regenerates into a
temporary tree and fails if anything differs, so the committed code can never drift
from the protos or from the pinned grpcio-tools.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # protoc plugins installed beside this Python
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def protos() -> list[Path]:
    return sorted((ROOT / "kxpu" / "api").rglob("*.proto"))


def generate(out: Path) -> None:
    rel = [str(p.relative_to(ROOT)) for p in protos()]
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={BIN / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={BIN / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *rel,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)


def generated_files(tree: Path) -> set[Path]:
    return {
        p.relative_to(tree) for p in (tree / "kxpu" / "api").rglob("*") if p.name.endswith(GENERATED_SUFFIXES)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh = generated_files(out)
        if args.check:
            committed = generated_files(ROOT)
            stale = sorted(str(p) for p in fresh ^ committed)
            stale += sorted(
                str(p) for p in fresh & committed if not filecmp.cmp(out / p, ROOT / p, shallow=False)
            )
            if stale:
                print("generated gRPC code is stale; run `make proto`:", *stale, sep="\n  ")
                return 1
            print(f"generated gRPC code is up to date ({len(fresh)} files)")
            return 0
        for p in fresh:
            shutil.copyfile(out / p, ROOT / p)
        print(f"wrote {len(fresh)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
