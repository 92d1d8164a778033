"""Regenerate the Python stubs of every .proto under protos/ (never edit the stubs by hand).

    python -m protos.generate            # writes protos/**/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python -m protos.generate --check    # exit 1 if a committed stub is stale (CI runs this)

Protos are compiled with the repository root as the include path, so `protos/pdserve/v1/x.proto`
becomes the module `protos.pdserve.v1.x_pb2` and imports between protos resolve the same way.
The proto packages themselves are `pdserve.v1` (public) and `pdserve.internal`.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root, the include path
PROTO_DIR = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into out_dir (mirroring the repository tree); returns the stubs."""
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    protos = [str(p.relative_to(ROOT)) for p in proto_files()]
    if not protos:
        return []
    args = ["protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    # the stubs land beside their protos, under out_dir/protos (out_dir may be the repository)
    return sorted(p for p in (out_dir / "protos").rglob("*") if p.name.endswith(SUFFIXES))


def stale_stubs() -> list[str]:
    """Stubs that differ from what the protos generate, or exist without a proto."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp): p for p in generate(Path(tmp))}
        committed = {p.relative_to(ROOT): p for p in PROTO_DIR.rglob("*")
                     if p.name.endswith(SUFFIXES)}
        problems = [f"missing: {rel}" for rel in fresh if rel not in committed]
        problems += [f"orphaned: {rel}" for rel in committed if rel not in fresh]
        problems += [f"stale: {rel}" for rel in fresh
                     if rel in committed and not filecmp.cmp(fresh[rel], committed[rel],
                                                             shallow=False)]
    return sorted(problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    if args.check:
        problems = stale_stubs()
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("run `python -m protos.generate` and commit the result", file=sys.stderr)
        return 1 if problems else 0
    for stub in generate(ROOT):
        print(stub.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
