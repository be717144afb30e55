"""Regenerate the committed stubs from xlaserve.proto: `python -m serving.protos.generate [--check]`.

Needs grpcio-tools (dev extra). protoc writes `import xlaserve_pb2` into the *_pb2_grpc module, an
absolute import that only works with this folder on sys.path; we rewrite it to a relative import so
the stubs live inside the `serving.protos` package. `--check` exits 1 when the committed stubs describe a
different API than the .proto (tests/serving/test_protos.py runs it): it compares the serialized
file descriptor and the RPC method paths, not the text, so a newer grpcio-tools (whose output names
its own version) does not count as a difference.
"""

from __future__ import annotations

import argparse
import ast
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


def api_of(stubs: dict[str, str]) -> tuple[bytes, tuple[str, ...]]:
    """(serialized FileDescriptorProto, sorted RPC method paths) of generated stub texts."""
    m = re.search(r"AddSerializedFile\((b'.*?')\)\n", stubs["xlaserve_pb2.py"], flags=re.S)
    if m is None:
        raise ValueError("xlaserve_pb2.py holds no serialized descriptor")
    methods = tuple(sorted(set(re.findall(r"'(/xlaserve\.v1\.\w+/\w+)'", stubs["xlaserve_pb2_grpc.py"]))))
    return ast.literal_eval(m.group(1)), methods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed stubs; write nothing")
    args = ap.parse_args(argv)
    fresh = generate()
    if not args.check:
        for name, text in fresh.items():
            (HERE / name).write_text(text)
        return 0
    committed = {name: (HERE / name).read_text() for name in OUTPUTS if (HERE / name).is_file()}
    if len(committed) != len(OUTPUTS) or api_of(committed) != api_of(fresh):
        print("the committed stubs do not match xlaserve.proto; run `python -m serving.protos.generate`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
