"""Regenerate the checked-in gRPC stubs from proto/ (run after editing a .proto).

python scripts/gen_proto.py           # write src/layerswarm/wire/v1/*_pb2*.py
python scripts/gen_proto.py --check   # exit 1 if the checked-in stubs differ (CI runs this via a test)
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "src"
PROTOS = ["layerswarm/v1/block.proto"]


def generate(out_dir: Path) -> list[Path]:
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    subprocess.run(cmd, check=True)
    return sorted((out_dir / "layerswarm" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    target = OUT / "layerswarm" / "wire" / "v1"
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        drift = []
        for path in generated:
            fixed = _fix_imports(path.read_text())
            dest = target / path.name
            if args.check:
                current = dest.read_text() if dest.exists() else ""
                if current != fixed:
                    drift.append(
                        "".join(
                            difflib.unified_diff(
                                current.splitlines(True), fixed.splitlines(True), str(dest), "generated"
                            )
                        )
                    )
            else:
                target.mkdir(parents=True, exist_ok=True)
                dest.write_text(fixed)
    if drift:
        print("generated stubs drifted from proto/; run: python scripts/gen_proto.py\n" + "\n".join(drift))
        return 1
    return 0


def _fix_imports(text: str) -> str:
    # protoc emits `from layerswarm.v1 import ...`; the stubs live in layerswarm.wire.v1.
    return text.replace("from layerswarm.v1 import", "from layerswarm.wire.v1 import")


if __name__ == "__main__":
    sys.exit(main())
