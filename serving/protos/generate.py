"""Regenerate the committed stubs from xlaserve.proto: `python -m serving.protos.generate [--check]`.

Needs grpcio-tools (dev extra). protoc writes `import xlaserve_pb2` into the *_pb2_grpc module, an
absolute import that only works with this folder on sys.path; we rewrite it to a relative import so
the stubs live inside the `serving.protos` package. `--check` exits 1 when the committed stubs differ
from what the .proto generates (tests/serving/test_protos.py runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "xlaserve.proto"
OUTPUTS = ("xlaserve_pb2.py", "xlaserve_pb2.pyi", "xlaserve_pb2_grpc.py")


def generate() -> dict[str, str]:
    """The stub files' contents, as protoc generates them from the .proto (imports made relative)."""
    from grpc_tools import protoc  # dev dependency: imported only here

    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                          f"--grpc_python_out={tmp}", str(HERE / PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {HERE / PROTO} (exit {rc})")
        out = {name: (Path(tmp) / name).read_text() for name in OUTPUTS}
    out["xlaserve_pb2_grpc.py"] = re.sub(r"^import xlaserve_pb2 as", "from . import xlaserve_pb2 as",
                                         out["xlaserve_pb2_grpc.py"], flags=re.M)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed stubs; write nothing")
    args = ap.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = HERE / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run `python -m serving.protos.generate`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
