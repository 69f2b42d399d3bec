"""Generates the Python stubs (messages, gRPC, and type stubs) from protos/ into asyncinfer/v1/.

    python scripts/gen_protos.py           # regenerate in place
    python scripts/gen_protos.py --check   # exit 1 when the committed stubs are stale

The stubs are committed so that users need neither protoc nor grpcio-tools.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE_DIR = Path("asyncinfer") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_root: Path) -> None:
    well_known = Path(protoc.__file__).parent / "_proto"
    # The mypy-protobuf plugins live beside this interpreter, whether or not its venv is on PATH.
    bin_dir = Path(sys.executable).parent
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / PACKAGE_DIR).glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(root: Path) -> dict[str, Path]:
    directory = root / PACKAGE_DIR
    return {p.name: p for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when the committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_root = Path(tmp)
        (tmp_root / PACKAGE_DIR).mkdir(parents=True)
        generate(tmp_root)
        fresh = generated_files(tmp_root)
        committed = generated_files(ROOT) if (ROOT / PACKAGE_DIR).exists() else {}
        if args.check:
            stale = sorted(
                name
                for name in fresh.keys() | committed.keys()
                if name not in fresh
                or name not in committed
                or not filecmp.cmp(fresh[name], committed[name], shallow=False)
            )
            if stale:
                print("stale generated stubs (run: python scripts/gen_protos.py):", *stale, sep="\n  ")
                return 1
            print(f"generated stubs are fresh ({len(fresh)} files)")
            return 0
        for name in committed.keys() - fresh.keys():
            committed[name].unlink()
        for name, path in fresh.items():
            shutil.copyfile(path, ROOT / PACKAGE_DIR / name)
        print(f"wrote {len(fresh)} files to {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
