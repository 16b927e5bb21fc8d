"""Regenerate the committed gRPC stubs from proto/, or check they are current.

  python scripts/gen_proto.py           write starjar/v1/*_pb2*.py
  python scripts/gen_proto.py --check   exit 1 if the committed stubs differ from proto/
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = "starjar/v1"


def generate(out_root: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.glob("starjar/v1/*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}"] + [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / OUT_PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        target = ROOT / OUT_PACKAGE
        stale = [f.name for f in fresh if not (target / f.name).is_file() or not filecmp.cmp(f, target / f.name, False)]
        extra = [p.name for p in target.glob("*_pb2*.py*") if p.name not in {f.name for f in fresh}]
        if args.check:
            if stale or extra:
                print(f"stale stubs: {stale + extra}; run python scripts/gen_proto.py", file=sys.stderr)
                return 1
            print("stubs are current")
            return 0
        target.mkdir(parents=True, exist_ok=True)
        for f in fresh:
            shutil.copy(f, target / f.name)
        for name in extra:
            (target / name).unlink()
        print(f"wrote {len(fresh)} files to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
